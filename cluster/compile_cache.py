"""Where compiled kernels are kept between starts: ``<cache_dir>/triton``, beside the SPS tables.

The Triton kernels of ``kernels/`` compile on their first launch (the engines' warm-up launches every variant)
into Triton's cache folder, ``$TRITON_CACHE_DIR``, by default ``~/.triton/cache``: in a container or a pod, gone
with it, so every start compiles again. One setting, the deployment's ``cache_dir`` (``--cache-dir``,
``$DSPARK_CACHE_DIR``), puts the start-up caches on a folder that outlives the process: SPS tables under
``<cache_dir>/sps`` (:mod:`cluster.sps_cache`), Triton's under ``<cache_dir>/triton``, and the scheduler's
detokeniser under ``<cache_dir>/tokenizers`` (:mod:`cluster.tokenizer_cache`).

Nothing else on the serving path needs a persisted cache: it does not use ``torch.compile`` (inductor's cache
matters only for the demo's training recipe), and CUDA graphs are captured in memory at every start.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

TRITON_ENV = "TRITON_CACHE_DIR"

_ours: str | None = None  # the value this module set in this process (a later call for the same folder is quiet)


def use_compile_cache(cache_root: Path) -> Path:
    """Point this process's Triton cache at ``<cache_root>/triton`` unless ``$TRITON_CACHE_DIR`` is set (a user's
    own choice wins); returns the folder in effect and logs it.

    Contract: call it in every process that builds an engine, before the first kernel launch. Triton reads
    the variable at each compilation and lookup (``triton.knobs.cache.dir``), so setting it after ``import
    triton`` but before a launch is enough. The folder is created when it can be; a folder that cannot be created
    (read-only volume) is left to Triton, which then fails or falls back as it does without this setting.
    """
    global _ours
    configured = os.environ.get(TRITON_ENV)
    if configured and configured == _ours:  # set here already (both engines of one process)
        return Path(configured)
    if configured:
        folder = Path(configured).expanduser()
        logger.info("Triton kernel cache: %s ($%s)", folder, TRITON_ENV)
        return folder
    folder = Path(cache_root).expanduser() / "triton"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        logger.warning("Triton kernel cache %s cannot be created (%s)", folder, error)
    os.environ[TRITON_ENV] = _ours = str(folder)
    logger.info("Triton kernel cache: %s (cache_dir)", folder)
    return folder
