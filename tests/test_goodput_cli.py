"""bench/goodput.py's trace handling: `--trace` takes a bundled name or any file; a malformed
trace stops it with `file:line: field: message` and exit 2 (only `--plan`: no dry-run starts)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WAIT = 60.0  # seconds: bound on every child process (subprocess.run kills it on timeout)


def goodput(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "goodput.py"), "--plan", *args],
                          capture_output=True, text=True, timeout=WAIT, cwd=cwd)


def test_trace_from_a_file_outside_the_repository(tmp_path):
    trace = tmp_path / "mine.csv"
    trace.write_text("t_seconds,event,node\n0,add,a\n0,add,b\n0,add,c\n0,add,d\n0,add,e\n"
                     "600,preempt,b\n900,add,f\n1200,preempt,e\n")
    done = goodput("--trace", str(trace), "--workers", "4", "--start", "300", "--window", "1200",
                   "--time-scale", "60", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "slots held by node-0=a, node-1=b, node-2=c, node-3=d" in done.stdout
    assert "t=   5.0s  reclaim   node-1, 10s notice" in done.stdout
    assert "t=  10.0s  capacity  node-1" in done.stdout


def test_bundled_trace_by_name_from_any_directory(tmp_path):
    done = goodput("--trace", "gcp-n1-v100x1-bamboo", "--workers", "4", "--start", "20000", "--window", "3000",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "trace gcp-n1-v100x1-bamboo.csv" in done.stdout and "reclaim   node-0" in done.stdout


def test_malformed_trace_exits_2_naming_file_line_and_field(tmp_path):
    trace = tmp_path / "bad.csv"
    trace.write_text("t_seconds,event,node\n0,add,a\n60,preempt,b\n")
    done = goodput("--trace", str(trace), cwd=tmp_path)
    assert done.returncode == 2
    assert f"{trace}:3: node: 'b' preempted while it is not live" in done.stderr and "Traceback" not in done.stderr


def test_unknown_trace_exits_2_listing_the_bundled_ones(tmp_path):
    done = goodput("--trace", "no-such-trace", cwd=tmp_path)
    assert done.returncode == 2
    assert "--trace: no-such-trace" in done.stderr and "aws-p3-bamboo" in done.stderr


def test_workers_beyond_the_global_batch_exit_2(tmp_path):
    done = goodput("--workers", "33", cwd=tmp_path)
    assert done.returncode == 2 and "--workers" in done.stderr and "<= 32" in done.stderr


def test_rounds_below_one_exit_2_naming_the_option(tmp_path):
    done = goodput("--rounds", "0", cwd=tmp_path)
    assert done.returncode == 2 and "--rounds" in done.stderr
