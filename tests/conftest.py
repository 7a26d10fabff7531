import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny models: threads only contend (see runtime._cpu_threads)

import tiny  # noqa: E402

# A suite started under `nohup` would hand its SIG_IGN for SIGHUP to every CLI run it starts; dflash-quant
# rightly leaves an ignored signal ignored, so the signal tests' runs would never stop. Give them the default.
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
# Likewise a suite started as a background job of a non-interactive shell ignores SIGINT, and its CLI runs would
# ignore Ctrl-C: restore Python's own handler (children then start with the default disposition).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(drafter_dir, target_dir) of a tiny random pair in the official layout."""
    root = tmp_path_factory.mktemp("tiny_pair")
    return tiny.save_drafter(root / "drafter"), tiny.save_target(root / "target")


@pytest.fixture(scope="session")
def reference_artifact(tmp_path_factory):
    """One real artifact: `run_gptq` on the shipped reference pair with tiny settings (about 10 s on 2 cores).

    The output lies outside the working directory and the command line names it by its absolute path, as a
    user's would, so tests can check that no machine path reaches any file of the artifact."""
    from dflash_quant.pipeline.job import GptqJob
    from dflash_quant.pipeline.run import run_gptq

    out = tmp_path_factory.mktemp("reference_run") / "reference-int4"
    job = GptqJob(
        output=out,
        calib_num_prompts=4,
        calib_max_new_tokens=16,
        eval_num_prompts=2,
        eval_max_new_tokens=16,
        device="cpu",
        command=["dflash-quant", "gptq", "--output", str(out)],
    )
    run_gptq(job)
    return out


@pytest.fixture(autouse=True, scope="session")
def _private_check_cache(tmp_path_factory):
    """The parity check's run cache (default ~/.cache/dflash-quant/check) goes to a per-session temp dir."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old
