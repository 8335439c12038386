"""The Responses API (`/v1/responses`): a conversation's next turn as a Response object."""
