# Sourced by .ci/run (bash). Defines ray_step: installs the ray extra (Ray and Ray Train at the version pyproject.toml
# pins) into .venv and runs tests/test_ray.py on a local Ray cluster of 2 CPUs that the tests start and stop
# (Horovod's RayExecutor and ElasticRayExecutor API, a worker killed mid-training, the elastic example, Ray Train
# with gpucomm's backend). Prints how long the install and the tests took; a failing test fails the step.

ray_step() {
    local t0=$SECONDS
    .venv/bin/pip install -q -e ".[ray]" || { echo "ray step: installing the ray extra failed"; return 1; }
    local t1=$SECONDS
    .venv/bin/python -m pytest -q -m ray tests/test_ray.py -p no:cacheprovider || return 1
    echo "ray step: install $((t1 - t0)) s, tests $((SECONDS - t1)) s (ray $(.venv/bin/python -c 'import ray; print(ray.__version__)'))"
}
