"""``hfl-deploy submit`` says a deployed run's rounds and its summary table while it waits
(hfl.deploy.submit.RoundsShown), as hfl-simulate prints them, where this host sees the run's
directory; elsewhere one line says where they are. The SuperLink here is a stand-in that plays back
a real run's metrics.jsonl one row per status query; tests/test_readme_tour.py runs the tour's
loopback deployment through the real processes and checks the same lines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hfl.deploy.submit import COMPLETED, RoundsShown, see_through
from hfl.output.console import plain_text, round_line, summary_renderable
from hfl.output.report import load_run
from hfl.runtime.simulate import run
from tests.conftest import SMALL, compose_cfg


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:  # noqa: ANN001
    """A real three-round run's directory, played back below."""
    run_dir = tmp_path_factory.mktemp("finished")
    run(compose_cfg(*SMALL, "runtime=inprocess"), run_dir)
    return run_dir


class PlayingBack:
    """A SuperLink whose run writes one more metrics.jsonl row (half a row first) per status query."""

    def __init__(self, source: Path, run_dir: Path) -> None:
        self.rows = (source / "metrics.jsonl").read_text().splitlines(keepends=True)
        self.source, self.run_dir, self.written = source, run_dir, 0

    def submit(self, config: dict, config_file: Path) -> int:
        return 7

    def run_info(self, run_id: int) -> tuple[str, str]:
        if self.written == len(self.rows):
            for name in ("summary.json", "report.md"):
                shutil.copy(self.source / name, self.run_dir / name)
            return COMPLETED, ""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        row = self.rows[self.written]
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(row)
        self.written += 1
        return "running", ""


def submit(link: PlayingBack, run_dir: Path, rounds: int) -> list[str]:
    said: list[str] = []
    config = {"overrides": "", "output-dir": str(run_dir.parent), "run-name": run_dir.name}
    status = see_through(link, config, run_dir / "unused.toml", timeout=60, restarts=0, reconnect_seconds=10,
                         poll=0.01, say=said.append, rounds=RoundsShown(run_dir, rounds, said.append))
    assert status == COMPLETED
    return "\n".join(said).splitlines()


def test_submit_says_each_round_once_then_the_summary_table(finished, tmp_path):
    run_dir = tmp_path / "out" / "run"
    lines = submit(PlayingBack(finished, run_dir), run_dir, 3)
    rows = [json.loads(line) for line in (finished / "metrics.jsonl").read_text().splitlines()]
    table = plain_text(summary_renderable(load_run(run_dir), None)).splitlines()
    assert lines == [f"hfl-deploy: run 7 submitted; outputs on the global host in {run_dir}",
                     *(round_line(row, 3) for row in rows), "hfl-deploy: run 7 finished:completed", *table]
    assert [line.split()[1] for line in lines if line.startswith("round ")] == ["1/3", "2/3", "3/3"]
    assert table[1].split()[0] == "model" and [row.split()[0] for row in table[2:5]] == ["PM", "level1", "GM"]


def test_a_half_written_row_waits_for_the_next_poll(finished, tmp_path):
    said: list[str] = []
    shown = RoundsShown(tmp_path, 3, said.append)
    first, second = (finished / "metrics.jsonl").read_text().splitlines(keepends=True)[:2]
    (tmp_path / "metrics.jsonl").write_text(first + second[:20])
    shown.poll()
    (tmp_path / "metrics.jsonl").write_text(first + second)
    shown.poll()
    shown.poll()
    assert [line.split()[1] for line in said] == ["1/3", "2/3"]


def test_a_run_directory_on_another_host_is_named_once(tmp_path):
    said: list[str] = []

    class Elsewhere:
        def submit(self, config: dict, config_file: Path) -> int:
            return 3

        def run_info(self, run_id: int) -> tuple[str, str]:
            return COMPLETED, ""

    status = see_through(Elsewhere(), {"overrides": "", "output-dir": "/srv/out", "run-name": "r"}, tmp_path / "x",
                         timeout=60, restarts=0, reconnect_seconds=10, poll=0.01, say=said.append,
                         rounds=RoundsShown(tmp_path / "absent", 3, said.append))
    assert status == COMPLETED
    assert said[1:] == ["hfl-deploy: run 3 finished:completed",
                        f"hfl-deploy: {tmp_path / 'absent'} is not on this host: the run's rounds, report.md and "
                        "plots are there on the global host"]
