"""The rig the tests and the benchmarks share, not shipped in any package: atedevd run as a
process (harness), kubelet's device-manager model and the stand-in that runs it on the wire, and
what it runs as inside a container (kubelet_model, kubelet_standin, container_*), a real systemd in a booted rootfs (container), a node's boot (node_boot), a package
upgrade (package_upgrade), a node agent and a tiny plugin beside atedevd, a metrics scraper."""
