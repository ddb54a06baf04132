"""``--ray``, ``--ray-workers``, ``--ray-worker-ram``, ``--ray-timeout`` on the commands
that load a model (run, serve, chat, bench) and on plan and doctor. Imports click only."""

from __future__ import annotations

import click

from colibri_core.cli.extend import LoadOptions


class RayOptions(LoadOptions):
    def options(self) -> list:
        return [
            click.option("--ray", "ray_address", default=None, metavar="ADDRESS|local",
                         help="Compute the routed experts on Ray expert workers: a cluster's ADDRESS (host:port, "
                              "ray://host:port, auto), or 'local' to start a Ray cluster here."),
            click.option("--ray-workers", type=int, default=2, show_default=True,
                         help="With --ray: expert workers (Ray actors), each owning a shard of the experts."),
            click.option("--ray-worker-ram", default=None,
                         help="With --ray: each worker's RAM budget for its experts, e.g. 8G (default: 80% of its "
                              "machine's available memory)."),
            click.option("--ray-timeout", type=float, default=30.0, show_default=True,
                         help="With --ray: seconds a worker may take to answer; then its experts are computed here."),
        ]

    def load_kwargs(self, values: dict) -> dict:
        address = values.get("ray_address")
        if address is None:
            return {}
        from colibri_core.errors import UsageError
        from colibri_core.units import parse_size

        workers, timeout = values.get("ray_workers", 2), values.get("ray_timeout", 30.0)
        if workers is None or workers < 1:
            raise UsageError(f"--ray-workers must be at least 1, got {workers}")
        if timeout is None or timeout <= 0:
            raise UsageError(f"--ray-timeout must be more than 0 seconds, got {timeout}")
        ram = values.get("ray_worker_ram")
        options = {"address": address, "workers": int(workers), "timeout": float(timeout),
                   "worker_ram": parse_size(ram) if ram is not None else None}
        return {"compute": "ray", "compute_options": options}

    def plan(self, blueprint, report: dict, values: dict) -> list[tuple[str, str]]:
        kwargs = self.load_kwargs(values)
        if not kwargs:
            return []
        from colibri_ray.plan import ray_plan

        return ray_plan(blueprint, report, kwargs["compute_options"])

    def doctor(self, model_dir, values: dict) -> list[tuple[str, str, str, str]]:
        kwargs = self.load_kwargs(values)
        if not kwargs:
            return []
        from colibri_ray.tier import check_workers

        return check_workers(model_dir, kwargs["compute_options"])
