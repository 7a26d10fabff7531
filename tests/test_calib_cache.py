"""--calib-cache: an entry is the Hessians and (for gptq-kl / sequential) the drafter inputs of one calibration;
nothing of another calibration passes for it."""

import pytest
import torch

from dflash_quant.calibration import cache
from dflash_quant.calibration.capture import CalibrationStats, DraftCall
from dflash_quant.calibration.hessian import HessianAccumulator


def _stats(n_prompts: int, seed: int, replay: bool, labels: bool = True) -> CalibrationStats:
    gen = torch.Generator().manual_seed(seed)
    acc = HessianAccumulator(8, name="fc")
    acc.add(torch.randn(16, 8, generator=gen))
    calls = [
        [
            DraftCall(
                torch.randn(1, 4, 8, generator=gen),
                torch.randn(1, 3, 8),
                torch.arange(7)[None],
                torch.randint(0, 50, (4,), generator=gen) if labels else None,
            )
        ]
        for _ in range(n_prompts)
    ]
    return CalibrationStats({"fc": acc}, "block", prompts=n_prompts, steps=n_prompts, replay=calls if replay else None)


def test_a_plain_entry_does_not_inherit_the_replay_of_an_earlier_calibration(tmp_path):
    """gptq-kl (with replay) on one prompt set, then plain GPTQ (no replay) on another under the key a later
    gptq-kl run asks for: that run must recapture, not read the first set's drafter inputs."""
    cache.save(tmp_path, _stats(5, 0, replay=True), {"prompts": "A"})
    plain = _stats(3, 1, replay=False)
    cache.save(tmp_path, plain, {"prompts": "B"})
    assert not (tmp_path / cache.REPLAY).exists()
    assert cache.load(tmp_path, {"prompts": "B"}, need_replay=True, device=torch.device("cpu")) is None
    got = cache.load(tmp_path, {"prompts": "B"}, need_replay=False, device=torch.device("cpu"))
    assert got is not None and torch.equal(got.hessians["fc"].xtx, plain.hessians["fc"].xtx)
    # with a replay of its own the entry serves gptq-kl: the same prompts' inputs come back
    kl = _stats(3, 2, replay=True)
    cache.save(tmp_path, kl, {"prompts": "B"})
    back = cache.load(tmp_path, {"prompts": "B"}, need_replay=True, device=torch.device("cpu"))
    assert back is not None and back.replay is not None and len(back.replay) == 3
    assert torch.equal(back.replay[2][0].noise, kl.replay[2][0].noise)  # type: ignore[index]
    assert torch.equal(back.replay[2][0].labels, kl.replay[2][0].labels)  # type: ignore[index,arg-type]


def test_a_replay_without_target_tokens_is_recaptured(tmp_path):
    """Entries from before the target's tokens were recorded beside each call cannot serve the label-based
    tuning losses: a run that needs the replay captures again; the Hessians still serve plain GPTQ."""
    cache.save(tmp_path, _stats(2, 0, replay=True, labels=False), {"prompts": "A"})
    assert cache.load(tmp_path, {"prompts": "A"}, need_replay=True, device=torch.device("cpu")) is None
    assert cache.load(tmp_path, {"prompts": "A"}, need_replay=False, device=torch.device("cpu")) is not None


def test_a_replay_changed_under_the_key_is_a_miss(tmp_path):
    """Another run saving into the directory between our reads of the key and of the tensors: its replay does not
    match the prompt count the key was written with, so the entry is recaptured instead of mixed."""
    cache.save(tmp_path, _stats(4, 0, replay=True), {"prompts": "A"})
    meta = (tmp_path / cache.META).read_text()
    cache.save(tmp_path, _stats(6, 1, replay=True), {"prompts": "C"})
    (tmp_path / cache.META).write_text(meta)  # the key of the first entry, the tensors of the second
    assert cache.load(tmp_path, {"prompts": "A"}, need_replay=True, device=torch.device("cpu")) is None


def test_entries_written_before_replay_counts_are_recaptured_for_replay(tmp_path):
    import json

    cache.save(tmp_path, _stats(2, 0, replay=True), {"prompts": "A"})
    meta = json.loads((tmp_path / cache.META).read_text())
    del meta["replay_prompts"]
    (tmp_path / cache.META).write_text(json.dumps(meta))
    assert cache.load(tmp_path, {"prompts": "A"}, need_replay=True, device=torch.device("cpu")) is None
    assert cache.load(tmp_path, {"prompts": "A"}, need_replay=False, device=torch.device("cpu")) is not None


def test_a_save_cut_short_leaves_no_entry_that_mixes_two_calibrations(tmp_path, monkeypatch):
    """A signal between the Hessians and the replay of a rewrite: the old entry's key must not find the new
    Hessians (the key is removed first and written last), and the next save works in the same directory."""
    cache.save(tmp_path, _stats(4, 0, replay=True), {"prompts": "A"})
    real = cache._atomic_save

    def interrupted(tensors, path):
        if path.name == cache.REPLAY:
            raise KeyboardInterrupt  # what Ctrl-C raises in the middle of the rewrite
        real(tensors, path)

    monkeypatch.setattr(cache, "_atomic_save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.save(tmp_path, _stats(6, 1, replay=True), {"prompts": "B"})
    monkeypatch.setattr(cache, "_atomic_save", real)
    for key in ({"prompts": "A"}, {"prompts": "B"}):
        assert cache.load(tmp_path, key, need_replay=False, device=torch.device("cpu")) is None
    again = _stats(6, 1, replay=True)
    cache.save(tmp_path, again, {"prompts": "B"})
    back = cache.load(tmp_path, {"prompts": "B"}, need_replay=True, device=torch.device("cpu"))
    assert back is not None and torch.equal(back.hessians["fc"].xtx, again.hessians["fc"].xtx)
