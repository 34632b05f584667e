"""Thread settings chosen by the backend (issue 7): the CPU backend takes the physical
cores the process may use, within its cgroup quota; OMP_NUM_THREADS and an explicit
num_threads (--num-threads, EMBER_NUM_THREADS) win."""

from __future__ import annotations

import os

import pytest
import torch

from ember.hardware import cpu
from ember.hardware.cpu import CPUBackend, cgroup_cpu_quota, cpu_thread_count


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _fake_sys(root, siblings: dict[int, str], cpu_max: str | None = None, v1: tuple[int, int] | None = None):
    for cpu_id, text in siblings.items():
        topo = root / "devices" / "system" / "cpu" / f"cpu{cpu_id}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(text + "\n")
    if cpu_max is not None:
        (root / "fs" / "cgroup").mkdir(parents=True, exist_ok=True)
        (root / "fs" / "cgroup" / "cpu.max").write_text(cpu_max + "\n")
    if v1 is not None:
        (root / "fs" / "cgroup" / "cpu").mkdir(parents=True, exist_ok=True)
        (root / "fs" / "cgroup" / "cpu" / "cpu.cfs_quota_us").write_text(f"{v1[0]}\n")
        (root / "fs" / "cgroup" / "cpu" / "cpu.cfs_period_us").write_text(f"{v1[1]}\n")
    return str(root)


def test_smt_siblings_count_once_and_the_quota_caps(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    smt = {i: f"{i % 4},{i % 4 + 4}" for i in range(8)}  # 4 cores x 2 hyperthreads
    assert cpu_thread_count(_fake_sys(tmp_path / "a", smt)) == 4
    assert cpu_thread_count(_fake_sys(tmp_path / "b", smt, cpu_max="250000 100000")) == 2  # 2.5 CPUs
    assert cpu_thread_count(_fake_sys(tmp_path / "c", smt, cpu_max="50000 100000")) == 1  # never 0
    assert cpu_thread_count(_fake_sys(tmp_path / "d", smt, cpu_max="max 100000")) == 4
    assert cpu_thread_count(_fake_sys(tmp_path / "e", smt, v1=(300000, 100000))) == 3
    assert cpu_thread_count(_fake_sys(tmp_path / "f", smt, v1=(-1, 100000))) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1, 5})  # both threads of one core
    assert cpu_thread_count(_fake_sys(tmp_path / "g", smt)) == 1
    assert cgroup_cpu_quota(str(tmp_path / "nothing")) is None


def test_cpu_backend_chooses_and_obeys(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu, "cpu_thread_count", lambda: 1)
    assert CPUBackend().configure_threads(None) == 1 == torch.get_num_threads()
    assert CPUBackend().configure_threads(2) == 2 == torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)  # as torch read it at start
    assert CPUBackend().configure_threads(None) == 3  # the user's variable is left alone


def test_engine_and_server_take_num_threads(tiny_llama_dir, monkeypatch, restore_threads):
    from ember import LLM
    from ember.api.settings import ServerSettings, engine_config_kwargs
    from ember.config import EngineConfig

    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=16, num_threads=1)
    assert llm.engine.num_threads == 1 == torch.get_num_threads()
    assert engine_config_kwargs(ServerSettings(num_threads=2))["num_threads"] == 2
    with pytest.raises(ValueError, match="num_threads must be a positive integer, got 0"):
        EngineConfig(num_threads=0)
    with pytest.raises(ValueError, match="--num-threads must be a positive integer, got 0"):
        ServerSettings(num_threads=0)
