"""Progress on a log (stderr not a terminal): timestamped lines when a stage starts, completes, and every
`every_s` seconds between, from a heartbeat, so a stage that has not advanced yet (at 27B: the batched greedy
decode of every calibration prompt, minutes under CPU offload) still says it is alive."""

from __future__ import annotations

import re
import time

from dflash_quant.cli.common import end_stages, handle_errors, log_stage

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
