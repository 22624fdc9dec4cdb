"""deploy/: the systemd units parse, every ExecStart is a real `ft` command whose flags `ft ... --help`
lists and whose arguments ft's parser accepts (with ft.env's values), the coordinator and the GPU worker
get the same engine config, and install.sh installs into a prefix (and changes nothing with --dry-run)."""
from __future__ import annotations

import configparser
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(REPO, "src")
DEPLOY = os.path.join(REPO, "deploy")
UNITS = ["ft.target", "ft-coordinator.service", "ft-gpu-worker@.service", "ft-cpu-worker@.service"]
SERVICES = UNITS[1:]
ENV = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


def read_unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)   # DeviceAllow= repeats (a list)
    parser.optionxform = str                       # systemd keys are case-sensitive
    with open(os.path.join(DEPLOY, name)) as fh:
        parser.read_file(fh)
    return parser


def read_env_file() -> dict[str, str]:
    values = {}
    with open(os.path.join(DEPLOY, "ft.env")) as fh:
        for line in fh:
            line = line.strip()
            if line and not line.startswith("#"):
                key, sep, value = line.partition("=")
                assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), line
                values[key] = value
    return values


def exec_argv(unit: str, instance: str = "0") -> list[str]:
    """ExecStart as systemd runs it: %i, ${VAR} (one word), $VAR (split at spaces)."""
    line = read_unit(unit)["Service"]["ExecStart"].replace("\\\n", " ").replace("%i", instance)  # "\" continues
    env = read_env_file()
    argv = []
    for word in line.split():
        braced = re.fullmatch(r"\$\{([A-Z_0-9]+)\}", word)
        bare = re.fullmatch(r"\$([A-Z_0-9]+)", word)
        if braced:
            argv.append(env[braced.group(1)])
        elif bare:
            argv += env[bare.group(1)].split()
        else:
            assert "$" not in word, f"{unit}: unexpanded variable in {word!r}"
            argv.append(word)
    return argv


@pytest.fixture(scope="module")
def help_texts() -> dict[str, str]:
    """`ft <subcommand> --help` of every subcommand the units run (one process each)."""
    texts = {}
    for sub in (("serve",), ("worker", "gpu"), ("worker", "cpu")):
        out = subprocess.run([sys.executable, "-m", "ftexpert.coordinator.cli", *sub, "--help"], cwd=REPO, env=ENV,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        texts[" ".join(sub)] = out.stdout
    return texts


@pytest.mark.parametrize("unit", UNITS)
def test_units_parse_and_belong_to_the_target(unit):
    cfg = read_unit(unit)
    assert cfg["Unit"]["Description"]
    if unit == "ft.target":
        assert cfg["Install"]["WantedBy"] == "multi-user.target"
        return
    service = cfg["Service"]
    assert cfg["Unit"]["PartOf"] == "ft.target" and cfg["Install"]["WantedBy"] == "ft.target"
    assert service["User"] == "ft" and service["EnvironmentFile"] == "/etc/ft/ft.env"
    assert service["LimitMEMLOCK"] == "infinity"
    assert service["Restart"] in ("always", "on-failure") and service["KillSignal"] == "SIGTERM"
    assert service["ExecStart"].startswith("/usr/local/bin/ft ")


@pytest.mark.parametrize("unit,command", [("ft-coordinator.service", "serve"),
                                          ("ft-gpu-worker@.service", "worker gpu"),
                                          ("ft-cpu-worker@.service", "worker cpu")])
def test_exec_start_is_a_real_ft_command(unit, command, help_texts):
    from ftexpert.coordinator.cli import build_parser

    argv = exec_argv(unit)
    assert argv[0] == "/usr/local/bin/ft" and " ".join(argv[1:1 + len(command.split())]) == command
    flags = [a.split("=")[0] for a in argv if a.startswith("--")]
    missing = [f for f in flags if not re.search(rf"(^|[\s,\[]){re.escape(f)}\b", help_texts[command], re.M)]
    assert not missing, f"{unit}: `ft {command} --help` lists no {missing}"
    args = build_parser().parse_args(argv[1:])          # every value is valid for its flag
    assert args._module in ("ftexpert.coordinator.serve_cli", "ftexpert.gpu_worker.worker_cli", "ftexpert.cpu_expert_pool.cli")


def test_the_coordinator_unit_resolves_the_engine_spec_and_the_gpu_worker_unit_takes_it():
    """The GPU worker's unit carries no engine flag (its parser would refuse one): the coordinator's unit does,
    and they make the spec WELCOME hands the worker."""
    from ftexpert.coordinator.cli import build_parser
    from ftexpert.proto.engine_spec import spec_from_args

    serve = build_parser().parse_args(exec_argv("ft-coordinator.service")[1:])
    worker = build_parser().parse_args(exec_argv("ft-gpu-worker@.service")[1:])
    assert serve.attach and serve.engine_addr == worker.engine_addr
    spec = spec_from_args(serve, read_env_file())
    assert (spec.model, spec.moe_strategy, spec.max_context_tokens) == ("/srv/ft/models/Qwen3-30B-A3B", "offload", 8192)
    assert "FT_ENGINE_ARGS" not in read_unit("ft-gpu-worker@.service")["Service"]["ExecStart"]


def test_env_file_holds_known_knobs_and_loopback_addresses():
    from ftexpert.proto.knobs import read_env
    from ftexpert.proto.link_io import check_loopback_address

    env = read_env_file()
    read_env(env)                                  # raises on an unknown or invalid FREETOKEN_* knob
    check_loopback_address(env["FT_ENGINE_ADDR"])
    assert env["FT_HOST"] == "127.0.0.1" and "FT_API_KEY" in env
    for key in ("FT_PORT", "FT_GRPC_PORT", "FT_NUM_CPU_WORKERS"):
        assert env[key].isdigit(), key


def test_ft_ctl_of_the_ft_user_finds_the_coordinators_control_key():
    """With FT_API_KEY empty the coordinator writes its control key in its RuntimeDirectory= (0700, user ft), where
    `sudo -u ft ft ctl`, which has no $RUNTIME_DIRECTORY, looks too."""
    from ftexpert.coordinator import control_key

    service = read_unit("ft-coordinator.service")["Service"]
    assert service["RuntimeDirectoryMode"] == "0700" and service["UMask"] == "0077"
    assert control_key.SYSTEMD_RUNTIME_DIR == f"/run/{service['RuntimeDirectory']}"
    assert control_key.SYSTEMD_RUNTIME_DIR in control_key.search_dirs({})
    assert control_key.search_dirs({"RUNTIME_DIRECTORY": "/run/ft"})[0] == "/run/ft"      # where it writes it


def _install(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", os.path.join(DEPLOY, "install.sh"), *args], capture_output=True, text=True,
                          timeout=60)


def test_install_dry_run_changes_nothing(tmp_path):
    out = _install("--dry-run", "--prefix", str(tmp_path), "--cpu-workers", "2", "--numa-nodes", "0 1")
    assert out.returncode == 0, out.stderr
    for unit in UNITS:
        assert f"would write {tmp_path}/etc/systemd/system/{unit} (mode 0644" in out.stdout
    assert f"would write {tmp_path}/etc/ft/ft.env (mode 0640" in out.stdout
    assert "ft-cpu-worker@1.service.d/numa.conf" in out.stdout
    assert "systemctl enable ft.target ft-coordinator.service ft-gpu-worker@0.service ft-cpu-worker@0.service " \
           "ft-cpu-worker@1.service" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_install_into_a_prefix(tmp_path):
    prefix = tmp_path / "root"
    out = _install("--prefix", str(prefix), "--ft-bin", "/opt/ft/bin/ft", "--cpu-workers", "auto",
                   "--numa-nodes", "0 1")
    assert out.returncode == 0, out.stderr
    units = prefix / "etc/systemd/system"
    for unit in UNITS:
        text = (units / unit).read_text()
        assert "/usr/local/bin/ft" not in text
    assert "ExecStart=/opt/ft/bin/ft serve --attach" in (units / "ft-coordinator.service").read_text()
    numa = (units / "ft-cpu-worker@1.service.d/numa.conf").read_text()
    assert "CPUAffinity=numa" in numa and "NUMAMask=1" in numa
    env = prefix / "etc/ft/ft.env"
    assert stat.S_IMODE(env.stat().st_mode) == 0o640 and "FT_NUM_CPU_WORKERS=2" in env.read_text()
    assert "ft - memlock unlimited" in (prefix / "etc/security/limits.d/ft.conf").read_text()
    env.write_text(env.read_text() + "FT_API_KEY=secret\n")
    again = _install("--prefix", str(prefix))
    assert again.returncode == 0 and "kept" in again.stdout
    assert "FT_API_KEY=secret" in env.read_text() and (prefix / "etc/ft/ft.env.new").exists()
    bad = _install("--prefix", str(prefix), "--ft-bin", "ft")
    assert bad.returncode == 2 and "absolute path" in bad.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_finds_nothing_to_say(tmp_path):
    ft_bin = tmp_path / "ft"
    ft_bin.write_text("#!/bin/sh\nexit 0\n")
    ft_bin.chmod(0o755)
    prefix = tmp_path / "root"
    assert _install("--prefix", str(prefix), "--ft-bin", str(ft_bin)).returncode == 0
    units = prefix / "etc/systemd/system"
    for template in ("ft-gpu-worker@.service", "ft-cpu-worker@.service"):      # verify wants instances
        shutil.copy(units / template, units / template.replace("@.", "@0."))
    names = ["ft.target", "ft-coordinator.service", "ft-gpu-worker@0.service", "ft-cpu-worker@0.service"]
    out = subprocess.run(["systemd-analyze", "verify", *[str(units / n) for n in names]], capture_output=True,
                         text=True, timeout=60, cwd=units)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


MAX_EXPOSURE = 4.0                      # systemd-analyze security's "OK" band ends at 4.9; we hold 4.0


@pytest.mark.parametrize("unit", SERVICES)
def test_services_notify_with_a_watchdog_and_no_start_deadlock(unit):
    cfg = read_unit(unit)
    service = cfg["Service"]
    assert service["Type"] == "notify" and int(service["WatchdogSec"]) > 0 and int(service["TimeoutStartSec"]) >= 600
    after = cfg["Unit"].get("After", "")
    # the coordinator says READY=1 only once its GPU worker is READY: a worker ordered after it would wait forever
    assert "ft-coordinator.service" not in after
    if "network-online.target" in after:
        assert "network-online.target" in cfg["Unit"].get("Wants", "")
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert service[key] == "yes", key
    assert service["ProtectSystem"] == "strict" and service["CapabilityBoundingSet"] == ""
    assert "MemoryDenyWriteExecute" not in service       # the CUDA driver and Triton JIT-compile


def _analyze_security(path: str) -> float:
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", path], capture_output=True, text=True,
                         timeout=60)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout + out.stderr)
    assert match, out.stdout + out.stderr
    return float(match.group(1))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", SERVICES)
def test_systemd_analyze_security_rates_every_unit_at_most_4(unit):
    exposure = _analyze_security(os.path.join(DEPLOY, unit))
    assert exposure <= MAX_EXPOSURE, f"{unit}: exposure {exposure} > {MAX_EXPOSURE}"
