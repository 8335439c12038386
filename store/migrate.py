"""Schema migrations, run through Alembic's API: `upgrade(url)` is `pagedbatch db upgrade`."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

# `migrations/` sits beside `store/` in the source tree, which the editable install runs from. A
# wheel keeps that layout if it ships the folder as `pagedbatch.migrations` next to
# `pagedbatch.store`, so this one path serves both.
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

# Where migrations/env.py finds the URL (see there why not in the main options).
DATABASE_URL_ATTRIBUTE = "pagedbatch.database_url"


def alembic_config(database_url: str) -> Config:
    """Alembic's configuration for our migrations against `database_url`, without an ini file.

    For other Alembic commands too, e.g. `command.revision(alembic_config(url), "msg",
    autogenerate=True)` to draft the next migration from the models.
    """
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise RuntimeError(f"the Alembic migrations are missing: no env.py in {MIGRATIONS_DIR}")
    config = Config()
    # Main options go through configparser, which reads "%" as interpolation.
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    config.attributes[DATABASE_URL_ATTRIBUTE] = database_url
    return config


def upgrade(database_url: str) -> None:
    """Bring the database to the newest schema; a database already there is left untouched.

    Several processes may run it at once on PostgreSQL: they take turns. Threads of one process
    may not, as Alembic keeps its running context in module globals.
    """
    command.upgrade(alembic_config(database_url), "head")
