"""Progress on a log (stderr not a terminal): timestamped lines when a stage starts, completes, and every
`every_s` seconds between, from a heartbeat, so a stage that has not advanced yet (at 27B: the batched greedy
decode of every calibration prompt, minutes under CPU offload) still says it is alive."""

from __future__ import annotations

import re
import time

import pytest
import torch

from dflash_quant.cli.common import end_stages, handle_errors, log_stage
from dflash_quant.loading.runtime import encode_prompts, load_pair
from dflash_quant.speculative.teacher import decode_detail, greedy_rows

LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] (.*)$")


def _lines(text: str) -> list[str]:
    return [m.group(1) for ln in text.splitlines() if (m := LINE.match(ln))]


def test_a_stage_that_does_not_advance_still_prints_and_stops_when_done(capsys):
    advance = log_stage("decoding", 2, every_s=0.3)
    time.sleep(1.0)  # no advance: only the heartbeat can print
    beats = _lines(capsys.readouterr().err)
    assert beats[0] == "decoding"
    assert len(beats) >= 3 and all(re.fullmatch(r"decoding: 0/2 \(\d+ s\)", b) for b in beats[1:]), beats
    advance()
    advance()
    assert _lines(capsys.readouterr().err)[-1].startswith("decoding: 2/2 ")
    time.sleep(0.8)  # complete: silent
    assert _lines(capsys.readouterr().err) == []


def test_a_new_stage_silences_the_old_one_and_the_command_end_silences_all(capsys):
    log_stage("loading", None, every_s=0.3)
    time.sleep(0.5)
    log_stage("writing", None, every_s=0.3)
    time.sleep(0.5)
    lines = _lines(capsys.readouterr().err)
    after = lines[lines.index("writing") + 1 :]
    assert after and all(re.fullmatch(r"writing: running \(\d+ s\)", ln) for ln in after), lines

    @handle_errors
    def command() -> None:
        log_stage("report", None, every_s=0.2)

    command()  # returns with its stage still open: the wrapper ends it
    capsys.readouterr()
    time.sleep(0.6)
    assert _lines(capsys.readouterr().err) == []
    end_stages()


def test_a_long_batched_decode_shows_its_token_beside_the_count(capsys):
    """The heartbeat of a stage whose item is a batch decode says which token it is at; the next count clears it
    (a stale token would claim progress that is not there)."""
    advance = log_stage("calibrating", 4, every_s=0.3)
    on_token = decode_detail(advance, 0, 2)
    assert on_token is not None
    on_token(37, 65)
    time.sleep(0.5)
    beats = _lines(capsys.readouterr().err)
    assert re.fullmatch(r"calibrating: 0/4 \(\d+ s, target's greedy decode of prompts 1-2: token 37/65\)", beats[-1])
    advance()
    time.sleep(0.5)
    after = _lines(capsys.readouterr().err)
    assert after and all(re.fullmatch(r"calibrating: 1/4 \(\d+ s\)", b) for b in after), after
    end_stages()
    # a plain callable (no CLI stage) gets no per-token callback
    assert decode_detail(lambda: None, 0, 1) is None and decode_detail(None, 0, 1) is None


@pytest.fixture(scope="module")
def pair_tiny():
    drafter, target = load_pair("reference", None, torch.device("cpu"), torch.float32)
    return drafter, target, encode_prompts(target, "reference:heldout", 2, True)


def test_the_teacher_decode_reports_every_token(pair_tiny):
    drafter, target, prompts = pair_tiny
    seen: list[tuple[int, int]] = []
    rows = greedy_rows(target.model, prompts, 6, drafter.model.target_layer_ids, torch.device("cpu"),
                       on_token=lambda k, n: seen.append((k, n)))  # fmt: skip
    assert seen == [(k, 7) for k in range(1, 8)] and all(len(r.continuation) == 7 for r in rows)
