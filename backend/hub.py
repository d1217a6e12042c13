"""Models named by their Hugging Face hub id, as vLLM takes them (`serve Qwen/Qwen2.5-7B-Instruct`),
found in the local hub cache: where `hf download` (or vLLM, or transformers) put them, or under
vLLM's --download-dir. Nothing is downloaded: a model the cache does not hold is a one-line
error that says where it was looked for and how to put it there."""

from __future__ import annotations

from pathlib import Path

from tokendance.backend.api import InvalidRequest


def cache(download_dir: str | None = None) -> Path:
    """The hub cache looked in: --download-dir, else huggingface_hub's (HF_HUB_CACHE, or
    HF_HOME/hub, or ~/.cache/huggingface/hub)."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def folder(name: str, revision: str | None = None, download_dir: str | None = None,
           what: str = "model", param: str = "model") -> Path:
    """`name` itself where it is a folder, else the snapshot of hub id `name` at `revision` (a
    branch, tag or commit; default main) in the cache. InvalidRequest naming `what` (the
    flag) and `param` (the field) where neither is there."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    where = cache(download_dir)
    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=where, local_files_only=True))
    except HFValidationError:
        raise InvalidRequest(f"{what} {name}: no such file or folder, nor a Hugging Face model id (such as "
                             "Qwen/Qwen2.5-0.5B-Instruct)", param) from None
    except LocalEntryNotFoundError:
        held = revisions(where / ("models--" + name.replace("/", "--")))
        if held:
            raise InvalidRequest(f"{what} {name} is in the Hugging Face cache at {where}, but not at revision "
                                 f"{revision or 'main'} (it holds {', '.join(held)})", param) from None
        raise InvalidRequest(f"{what} {name}: no such file or folder, nor a model in the Hugging Face cache at "
                             f"{where} (nothing is downloaded: `hf download {name}` puts it there)", param) from None


def revisions(repo: Path) -> list[str]:
    """The revisions a repo's cache folder holds: its branches and tags, then the commits
    no name points at (12 digits)."""
    refs = repo / "refs"
    named = {p.relative_to(refs).as_posix(): p.read_text().strip() for p in refs.rglob("*") if p.is_file()} \
        if refs.is_dir() else {}
    snaps = sorted(p.name for p in (repo / "snapshots").glob("*") if p.is_dir())
    return [*sorted(named), *(s[:12] for s in snaps if s not in named.values())]
