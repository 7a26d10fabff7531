"""Where a model lives: a local directory, a shipped pair's part (`reference`, `reference:target`), or a Hub repo
id fetched into the Hugging Face cache (safetensors and config files only; HF_HUB_OFFLINE honoured)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from dflash_quant.errors import DFlashQuantError
from dflash_quant.reference import is_shipped, pair_dir, parse_shipped, shipped_id

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.md", "tokenizer*", "*.jinja"]


@dataclass
class Source:
    """Where a model came from, for provenance. kind: `hub`, `shipped` (inside dflash_quant/reference/) or `local`."""

    id: str
    path: Path
    revision: str | None = None
    kind: str = "local"


def resolve(src: str | Path, revision: str | None = None) -> Source:
    """A local directory, the `reference` pair shortcuts, or a Hub repo id (cache; HF_HUB_OFFLINE honoured)."""
    text = str(src)
    shipped = parse_shipped(text)
    if shipped:
        name, part = shipped
        return Source(id=shipped_id(name, part), path=pair_dir(name) / part, kind="shipped")
    path = Path(text).expanduser()
    if path.is_dir():
        return Source(id=text, path=path, revision=revision, kind="shipped" if is_shipped(path) else "local")
    if path.exists():
        raise DFlashQuantError(f"{path} is a file; pass the model directory that contains config.json")
    if not HUB_ID.match(text):
        raise DFlashQuantError(f"{text} is neither an existing directory nor a Hub repo id (ORG/NAME); check the path")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    # `out/run-1` reads as a repo id too: when its first part is a folder here, it was most likely meant as a path
    local = f"there is no directory {text} here, and " if path.parent.is_dir() and path.parent != Path(".") else ""
    try:
        fetched = snapshot_download(text, revision=revision, allow_patterns=WEIGHT_PATTERNS)
    except RepositoryNotFoundError as exc:
        fix = "check the path (or the repo id, or set HF_TOKEN)" if local else "check the id or set HF_TOKEN"
        raise DFlashQuantError(f"{local}Hub repo {text} is not found or not accessible; {fix}") from exc
    except LocalEntryNotFoundError as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = "it is not in the local cache (HF_HUB_OFFLINE is set)" if offline else "download failed"
        fix = "check the path" if local else "download it first or pass a local directory"
        raise DFlashQuantError(f"{local}cannot fetch {text} from the Hub: {hint}; {fix}") from exc
    except HfHubHTTPError as exc:
        fix = "check the path (or the network and token)" if local else "check the network and token"
        raise DFlashQuantError(f"{local}cannot fetch {text} from the Hub ({exc.__class__.__name__}); {fix}") from exc
    return Source(id=text, path=Path(fetched), revision=revision, kind="hub")
