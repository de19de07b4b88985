"""The demo's monitoring sections: on by default, a user's own config keys kept."""

from pathlib import Path

from zeroshard.demo.monitoring import CSV_JOB_NAME, csv_folder, with_monitoring, write_report_pngs
from zeroshard.demo.train import default_config
from zeroshard.resolve import resolve_config


def test_embedded_config_gets_csv_monitor_in_the_run_dir_and_timers(tmp_path) -> None:
    base = default_config(total_steps=10, on_gpu=False)
    config = with_monitoring(base, tmp_path)
    assert "csv_monitor" not in base and "wall_clock_breakdown" not in base  # a copy, not edited
    resolved = resolve_config(config, world_size=2)
    assert resolved.wall_clock_breakdown is True
    assert csv_folder(resolved) == tmp_path / CSV_JOB_NAME


def test_a_config_that_sets_the_keys_keeps_them(tmp_path) -> None:
    base = default_config(total_steps=10, on_gpu=False)
    base["csv_monitor"] = {"enabled": False}
    base["wall_clock_breakdown"] = False
    resolved = resolve_config(with_monitoring(base, tmp_path), world_size=2)
    assert resolved.wall_clock_breakdown is False
    assert csv_folder(resolved) is None
    assert write_report_pngs(None, tmp_path) == ([], "csv_monitor is off in the config")


def test_no_csv_files_is_a_reason_not_an_error(tmp_path) -> None:
    pngs, reason = write_report_pngs(Path(tmp_path), tmp_path)
    assert pngs == [] and "no CSV series found" in reason
    assert list(tmp_path.iterdir()) == []
