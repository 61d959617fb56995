"""run/monitor.py's LossMonitor on rank 0: metrics.jsonl rows, the log line every per_print_times steps, and the
progress bar (on for a terminal, forced here; absent when output is not a terminal, as under CI)."""
import io
import json


def _monitor(tmp_path, **kw):
    from msparallel_ds.run.monitor import LossMonitor

    lines = []
    mon = LossMonitor(str(tmp_path), per_print_times=2, total_steps=3, rank=0, world=1, n_params=10,
                      echo=lines.append, **kw)
    for step in (1, 2, 3):
        mon.log(step, 2.0 / step, 1e-3, 0.5, tokens=64, seconds=0.1)
    mon.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return mon, lines, rows


def test_monitor_logs_every_per_print_times_and_writes_every_step(tmp_path):
    mon, lines, rows = _monitor(tmp_path, progress=False)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["loss"] == 1.0 and rows[0]["grad_norm"] == 0.5
    assert [ln.split(" loss")[0] for ln in lines] == ["step 2/3", "step 3/3"] and "grad norm 0.5000" in lines[0]
    assert mon._bar.disable


def test_monitor_progress_bar_counts_the_steps(tmp_path):
    out = io.StringIO()
    mon, lines, rows = _monitor(tmp_path, progress=True, bar_file=out)
    text = out.getvalue()
    assert "3/3" in text and "loss=0.6667" in text, text
    assert "step 2/3 loss 1.000000" in text and not lines  # log lines go above the bar, not to echo
    assert len(rows) == 3
