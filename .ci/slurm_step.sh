# Sourced by .ci/run (bash). Defines slurm_step: installs Debian's Slurm (slurm-wlm: slurmctld, slurmd and
# the clients; munge) and runs tests/test_slurm.py against a cluster that tests/slurm_cluster.py starts from a
# temporary directory and removes again (its own slurm.conf, munge key and socket, free ports; nothing global is
# configured, and a system munged or slurmctld that the installer may have started is not used). The tests
# submit real sbatch and srun jobs: the launch/slurm.sbatch recipe, Slurm's world detection, a task that dies,
# and two nodes made of network namespaces where they can be made. Root only; skips and says why without root
# or apt-get, or when the packages cannot be installed (as .ci/run does for its own packages).

slurm_step() {
    if [ "$(id -u)" != 0 ]; then
        echo "slurm step skipped: the Slurm daemons run as root (SlurmUser=root)"
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "slurm step skipped: apt-get is missing, so slurm-wlm and munge cannot be installed here"
        return 0
    fi
    local pkgs="slurm-wlm munge" t0=$SECONDS
    apt-get install -y -q --no-install-recommends $pkgs >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $pkgs >/dev/null 2>&1; } \
        || { echo "slurm step skipped: could not install $pkgs (apt-get install failed, also after apt-get update)"; return 0; }
    local t1=$SECONDS
    .venv/bin/python -m pytest -q -m slurm tests/test_slurm.py -p no:cacheprovider || return 1
    echo "slurm step: install $((t1 - t0)) s, tests $((SECONDS - t1)) s ($(slurmctld -V 2>/dev/null || echo 'slurm version unknown'))"
}
