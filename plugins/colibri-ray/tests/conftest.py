"""One local Ray cluster for the whole session (starting one costs seconds), and two
pools of expert workers on it (2 and 3 actors, each its own process) that the oracle
tests open their models on."""

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    # logical CPUs for the actors (each takes one); a small object store: the payloads are tiny
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False,
             namespace="colibri-ray-tests", object_store_memory=128 << 20)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def pools(ray_cluster):
    from colibri_ray.tier import WorkerPool

    made = {n: WorkerPool(n) for n in (2, 3)}
    yield made
    for pool in made.values():
        pool.close()
