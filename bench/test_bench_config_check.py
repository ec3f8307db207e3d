"""bench/config_check.py: a smoke run (``make bench``): every case is rejected with exit code 2,
every figure is there.  No time is asserted."""

import json

from bench import config_check


def test_config_check_bench_reports_every_case(tmp_path):
    path = tmp_path / "config_check.json"
    assert config_check.main(["--repeat", "1", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    for name in (*config_check.REFERENCES, *config_check.CASES):
        assert r["cpu_s"][name] > 0, name
    assert set(r["over_import_torch"]) == set(config_check.CASES)
    assert r["config_modules"] == len(r["config_module_names"]) > 0
    assert isinstance(r["config_imports_torch"], bool)
