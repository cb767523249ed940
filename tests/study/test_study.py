"""The paper's study (`python workflow.py study`, issue 33): a grid of trainings over rank counts
and learning rates, its cells on real or virtual ranks, its jobs on each site, and its answer."""

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from workflow_runs import ROOT, tiny_variant, tries, workflow

from pipeline.core.errors import ConfigError
from pipeline.study import analysis
from pipeline.study.study_grid import StudyCell, StudyConfig, rates_for, study_cells
from pipeline.training.lr_scaling import world_learning_rate
from pipeline.training.train_config import TrainConfig
from pipeline.training.train_metrics import CSV_COLUMNS

STUDY = ROOT / "configs" / "study.toml"
TRAIN = TrainConfig(learning_rate=0.001, warmup_steps=20)


class TestGrid:
    def test_rates_span_the_square_root_and_the_linear_rule_at_every_rank_count(self):
        study = StudyConfig(rank_counts=(1, 32), rates_per_rank_count=4, rate_margin=2.0)
        for n in (1, 32):
            rates = rates_for(study, 0.001, n)
            assert len(rates) == 4 and list(rates) == sorted(rates)
            assert rates[0] == pytest.approx(0.001 * math.sqrt(n) / 2)
            assert rates[-1] == pytest.approx(0.001 * n * 2)

    def test_ranks_beyond_the_machine_are_virtual_ranks_of_its_processes(self):
        study = StudyConfig(rank_counts=(1, 2, 6, 32), rates_per_rank_count=1, repeats=1)
        split = {c.ranks: (c.real_ranks, c.virtual_ranks) for c in study_cells(study, TRAIN, 4)}
        assert split == {1: (1, 1), 2: (2, 1), 6: (3, 2), 32: (4, 8)}
        on_a_batch_site = study_cells(study, TRAIN, None)
        assert all(c.real_ranks == c.ranks for c in on_a_batch_site)
        capped = study_cells(replace(study, max_real_ranks=1), TRAIN, None)
        assert {c.real_ranks for c in capped} == {1}

    def test_every_cell_of_the_grid_once_with_a_name_of_its_own(self):
        study = StudyConfig(
            rank_counts=(1, 4), optimizers=("adam", "sgd_momentum"), warmup=(True, False), repeats=2
        )
        cells = study_cells(study, TRAIN, 2)
        assert len(cells) == 2 * 4 * 2 * 2 * 2
        assert len({c.name for c in cells}) == len(cells)
        assert {c.seed for c in cells} == {TRAIN.seed, TRAIN.seed + 1}

    def test_a_cell_trains_at_its_rate_after_the_warm_up_from_one_ranks_share(self):
        cell = StudyCell(8, 0.004, "sgd_momentum", True, 3, real_ranks=2)
        config = cell.train_config(TRAIN, steps=100)
        assert (config.virtual_ranks, config.optimizer, config.seed, config.max_steps) == (
            4,
            "sgd_momentum",
            3,
            100,
        )

        def rate(step: int, config: TrainConfig = config) -> float:
            return world_learning_rate(
                config.learning_rate, [(0, 8)], config.lr_policy, step, config.warmup_steps
            )

        assert rate(0) == pytest.approx(0.004 / 8)
        assert rate(20) == pytest.approx(0.004) and rate(99) == pytest.approx(0.004)
        constant = replace(cell, warmup=False).train_config(TRAIN, steps=100)
        assert world_learning_rate(
            constant.learning_rate, [(0, 8)], constant.lr_policy, 0, 20
        ) == pytest.approx(0.004)

    @pytest.mark.parametrize(
        "settings, message",
        [
            ({"rank_counts": ()}, "rank_counts is empty"),
            ({"rank_counts": (1, 2), "steps": 20}, "warmup_steps"),
            ({"rank_counts": (1,), "learning_rates": (0.001, 0.0)}, "must be > 0"),
            ({"rank_counts": (1,), "learning_rates": (float("nan"),)}, "must be > 0"),
            ({"rank_counts": (1, 0)}, "integers >= 1"),
            ({"rank_counts": (2, 2)}, "repeats a count"),
            ({"rank_counts": (1,), "optimizers": ("lamb",)}, "lamb"),
        ],
    )
    def test_a_grid_that_cannot_run_is_refused(self, settings, message):
        with pytest.raises(ConfigError, match=message):
            study_cells(StudyConfig(**settings), TRAIN, 2)


def fake_cell(
    ranks: int, rate: float, seed: int, accuracy: float, steps: int = 100
) -> analysis.CellMetrics:
    """A cell whose logged accuracy rises to `accuracy`, with F1 crossing 0.8 at a step that
    falls as N grows."""
    rows = np.arange(10, steps + 1, 10, dtype=float)
    metrics = {name: np.zeros(rows.size) for name in CSV_COLUMNS}
    metrics["step"] = rows
    metrics["wall_s"] = rows * 0.1
    metrics["accuracy"] = accuracy * rows / steps
    metrics["f1"] = np.minimum(1.0, rows / steps * ranks**0.5)
    metrics["fov_per_s"] = np.full(rows.size, 10.0 * ranks)
    return analysis.CellMetrics(StudyCell(ranks, rate, "adam", True, seed, ranks), metrics)


def grid(best_rate, counts=(1, 2, 4, 8, 16, 32, 64, 128), seeds=2) -> list[analysis.CellMetrics]:
    """Cells at rates around `best_rate(N)` whose accuracy peaks there."""
    cells = []
    for n in counts:
        for step in range(-3, 4):
            rate = best_rate(n) * 2 ** (step / 2)
            for seed in range(seeds):
                cells.append(fake_cell(n, rate, seed, 0.9 - 0.02 * abs(step) - 0.001 * seed))
    return cells


class TestAnswer:
    study = StudyConfig(rank_counts=(1,), f1_threshold=0.8)

    def test_the_fitted_exponent_is_that_of_the_best_rates(self):
        for a in (1.0, 0.5):
            summary = analysis.setting_summary(
                grid(lambda n, a=a: 1e-3 * n**a), self.study, ("adam", True)
            )
            assert summary["exponent"] == pytest.approx(a, abs=0.02)
            assert summary["exponent_sd"] == pytest.approx(0, abs=0.02)

    def test_the_answer_names_the_papers_shift_where_the_best_rate_shows_it(self):
        def shifted(n):  # linear to 16 ranks, square root beyond: Dong et al.'s finding
            return 1e-3 * n if n <= 16 else 1e-3 * 16 * math.sqrt(n / 16)

        summary = analysis.setting_summary(grid(shifted), self.study, ("adam", True))
        assert summary["closer_rule"][128] == "sqrt" and summary["closer_rule"][8] == "linear"
        assert (
            "linearly up to 16 ranks" in summary["answer"]
            and "from 32 ranks on" in summary["answer"]
        )
        linear = analysis.setting_summary(grid(lambda n: 1e-3 * n), self.study, ("adam", True))
        assert linear["answer"].startswith("The best rate grows as N^1.00 (+- 0.00 over seeds).")
        assert "linearly (with warm-up) up to 128 ranks" in linear["answer"]

    def test_steps_to_the_f1_threshold_and_strong_scaling(self):
        cells = grid(lambda n: 1e-3 * n, counts=(1, 4))
        summary = analysis.setting_summary(cells, self.study, ("adam", True))
        # F1 rises by 0.1 (N = 1) and 0.2 (N = 4) per row: the mean of 3 rows reaches 0.8 a row
        # after one row does.
        assert summary["time_to_f1"][1]["steps"] == 90 and summary["time_to_f1"][4]["steps"] == 50
        assert summary["time_to_f1"][4]["step_efficiency"] == pytest.approx(90 / (4 * 50))
        scaling = analysis.strong_scaling(cells)
        assert scaling[4]["fov_per_s"] == pytest.approx(40) and scaling[4][
            "efficiency"
        ] == pytest.approx(1)


def study_config(folder: Path, name: str, study: str, **replacements: str) -> Path:
    """configs/tiny.toml (its model and volume) with a [study] section."""
    path = tiny_variant(folder, name, replacements)
    path.write_text(path.read_text() + "\n[study]\n" + study + "\n")
    return path


PAPER_SCALE = "rank_counts = [1, 4, 16, 64, 256, 1024]\nsteps = 10000"
SIX_HOURS = [
    "--walltime",
    "06:00:00",
    "--cpu-walltime",
    "01:00:00",
]  # the cpu pool's debug queue: 1 h


@pytest.mark.parametrize(
    "site, allocation, job",
    [
        ("theta", ["--queue", "default", "--cpu-queue", "debug-cache-quad", *SIX_HOURS],
         "1024 node(s) x 06:00:00 each (6,144.0 node-hours)"),
        ("polaris", ["--queue", "prod", "--cpu-queue", "debug", *SIX_HOURS],
         "256 node(s) x 06:00:00 each (1,536.0 node-hours)"),
        ("slurm", ["--walltime", "06:00:00"], "256 node(s) x 06:00:00 each (1,536.0 node-hours)"),
    ],
)  # fmt: skip
def test_the_study_dry_run_prints_its_cells_jobs_and_node_hours_on_each_site(
    tmp_path, site, allocation, job
):
    config = study_config(tmp_path, "paper_scale", PAPER_SCALE)
    done = workflow("study", "--site", site, *allocation, "--config", str(config), "--dry-run",
                    "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert f"jobs: {job}" in done.stdout
    assert "N=1024  8 cells" in done.stdout and "(real ranks)" in done.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "study, site, message",
    [
        ("rank_counts = []", "local", "the config has no [study] rank_counts"),
        ("rank_counts = [1, 2]\nsteps = 5", "local", "warmup_steps"),
        ("rank_counts = [1, 2]\nlearning_rates = [0.001, -0.001]", "local", "must be > 0"),
        ("rank_counts = [1, 6]", "polaris", "6 ranks do not fill whole nodes of 4 ranks"),
        ("rank_counts = [1, 64]", "theta", "needs a job of 64 nodes for 01:00:00"),
    ],
)
def test_a_study_that_cannot_run_gets_one_line_and_nothing_is_made(tmp_path, study, site, message):
    config = study_config(
        tmp_path, "bad", study, **{"max_steps = 30": "max_steps = 30\nwarmup_steps = 10"}
    )
    run_dir = tmp_path / "run"
    done = workflow(
        "study", "--site", site, "--config", str(config), "--run-dir", str(run_dir), expect=2
    )
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not run_dir.exists()


def test_a_study_runs_as_a_study_and_a_run_as_a_run(tmp_path):
    config = study_config(tmp_path, "a_study", "rank_counts = [1, 2]")
    done = workflow("--config", str(config), "--run-dir", str(tmp_path / "run"), expect=2)
    assert "run it with `python workflow.py study`" in done.stderr


@pytest.mark.mpi
@pytest.mark.slow
def test_a_small_study_reports_its_answer_and_resumes_only_unfinished_cells(tmp_path):
    study = "rank_counts = [1, 4]\nrates_per_rank_count = 2\nrepeats = 2\nsteps = 12"
    config = study_config(
        tmp_path, "small_study", study, **{"max_steps = 30": "max_steps = 30\nwarmup_steps = 4"}
    )
    run_dir = tmp_path / "run"
    workflow("study", "--site", "local", "--config", str(config), "--run-dir", str(run_dir))

    results = json.loads((run_dir / "study" / "results.json").read_text())
    cells = {c["name"]: c for c in results["cells"]}
    assert len(cells) == 2 * 2 * 2
    assert {(c["ranks"], c["real_ranks"], c["virtual_ranks"]) for c in cells.values()} == {
        (1, 1, 1),
        (4, 2, 2),
    }
    assert all(c["final"]["step"] == 12 for c in cells.values())
    for cell in cells.values():  # each cell trained as its world: N ranks' rate at its last step
        summary = json.loads(
            (run_dir / "study" / "cells" / cell["name"] / "train_summary.json").read_text()
        )
        assert summary["world_size"] == cell["ranks"]
        assert cell["final"]["learning_rate"] == pytest.approx(cell["learning_rate"], rel=1e-4)
    report = (run_dir / "study" / "report.md").read_text()
    assert "Fitted exponent a" in report and "virtual ranks at 4" in report
    for figure in (
        "fig4_rates_0.png",
        "fig5_time_to_f1_0.png",
        "fig6_curves_0.png",
        "fig3_strong_scaling.png",
    ):
        assert (run_dir / "study" / figure).stat().st_size > 10_000, figure
    assert "[study/report.md](study/report.md)" in (run_dir / "report.md").read_text()

    # A cell lost (its folder gone): the resume trains that cell and writes the report again.
    lost = sorted(cells)[-1]
    shutil.rmtree(run_dir / "study" / "cells" / lost)
    done = workflow("study", "--run-dir", str(run_dir), "--resume")
    assert f"train[{lost}]" in done.stdout
    assert tries(run_dir) == {"train": 1, "report_study": 1}
    assert (run_dir / "study" / "cells" / lost / "train_summary.json").is_file()
