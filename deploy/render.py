"""Keep the RayService's embedded Serve config identical to deploy/serve_config.gpu.yaml.

One file describes the deployment everywhere: ``serve_config.gpu.yaml`` is the source, and the ``serveConfigV2``
block of ``rayservice.yaml`` is that file's text, indented, so ``dspark serve --config``, ``serve deploy`` and
KubeRay all read the same thing. The rest of the manifest (comments included) is left as written; only the
block is rewritten, which is why this works on text rather than through a YAML round trip.

    python deploy/render.py            # rewrite the block
    python deploy/render.py --check    # exit 1 when the committed manifest is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "rayservice.yaml"
SERVE_CONFIG = HERE / "serve_config.gpu.yaml"
BLOCK_KEY = "  serveConfigV2: |"
BLOCK_INDENT = "    "


def render(manifest: str, serve_config: str) -> str:
    """``manifest`` with the literal block under ``spec.serveConfigV2`` replaced by ``serve_config``."""
    lines = manifest.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip("\n") == BLOCK_KEY]
    if len(starts) != 1:
        raise ValueError(f"the manifest needs exactly one line {BLOCK_KEY!r} (a literal block under spec)")
    begin = end = starts[0] + 1
    # The block runs until the first non-blank line indented less than its content.
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(BLOCK_INDENT)):
        end += 1
    while end > begin and not lines[end - 1].strip():  # blank lines before the next key are not the block's
        end -= 1
    if not serve_config.endswith("\n"):
        serve_config += "\n"
    body = [BLOCK_INDENT + line if line.strip() else "\n" for line in serve_config.splitlines(keepends=True)]
    return "".join(lines[:begin] + body + lines[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if the manifest is out of date")
    args = parser.parse_args(argv)
    current = MANIFEST.read_text()
    rendered = render(current, SERVE_CONFIG.read_text())
    if args.check:
        if rendered != current:
            print(f"{MANIFEST} is out of date: run python deploy/render.py", file=sys.stderr)
            return 1
        return 0
    if rendered != current:
        MANIFEST.write_text(rendered)
        print(f"updated {MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
