"""The RAM tier's default run name: the same job (restarted or requeued) finds its RAM snapshots, a new job does not."""

from __future__ import annotations

import pytest

from lightning_snapshot.backends.ram.tier import JOB_ID_VARIABLES, default_run_name, job_ids

URLS = ["/nvme/snap/run-42", "s3://bucket/run-42"]


@pytest.fixture
def no_job(monkeypatch):
    for var in JOB_ID_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_without_a_job_id_the_name_depends_on_script_directory_and_tiers(no_job, tmp_path):
    name = default_run_name(URLS)
    assert name == default_run_name(list(URLS)) and name.startswith("run-") and len(name) == 20
    assert default_run_name(URLS[:1]) != name
    no_job.chdir(tmp_path)
    assert default_run_name(URLS) != name
    assert job_ids() == []


@pytest.mark.parametrize("var", JOB_ID_VARIABLES)
def test_each_job_id_makes_a_new_job_a_new_run(no_job, var):
    without = default_run_name(URLS)
    no_job.setenv(var, "1001")
    first = default_run_name(URLS)
    assert first != without and job_ids() == [f"{var}=1001"]
    assert default_run_name(URLS) == first  # the same job (a restart, a requeued job) keeps its name
    no_job.setenv(var, "1002")
    assert default_run_name(URLS) not in (first, without)


def test_ids_of_different_launchers_do_not_collide(no_job):
    no_job.setenv("SLURM_JOB_ID", "77")
    slurm = default_run_name(URLS)
    no_job.delenv("SLURM_JOB_ID")
    no_job.setenv("PBS_JOBID", "77")
    assert default_run_name(URLS) != slurm
    no_job.setenv("SLURM_JOB_ID", "77")  # torchrun inside a SLURM job: both count, in a fixed order
    assert job_ids() == ["SLURM_JOB_ID=77", "PBS_JOBID=77"]


@pytest.mark.parametrize("value", ["none", "None", "", "  "])
def test_torchrun_default_run_id_names_no_job(no_job, value):
    without = default_run_name(URLS)
    no_job.setenv("TORCHELASTIC_RUN_ID", value)
    assert job_ids() == [] and default_run_name(URLS) == without


def test_job_ids_reads_a_given_environment():
    assert job_ids({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "9", "JOB_COMPLETION_INDEX": "3"}) == [
        "TORCHELASTIC_RUN_ID=abc",
        "SLURM_JOB_ID=9",
    ]
