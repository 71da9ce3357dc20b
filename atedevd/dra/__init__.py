"""DRA mode (`[daemon] api = "dra"`, docs/dra.md): the same judged devices, served through
Dynamic Resource Allocation instead of the device plugin API.

Pure cores beside their I/O: `slices` (what the node publishes, and the DeviceClasses that name
it) and `claims` (which claims are prepared, and what each was answered) decide; `checkpoint`
(the claims on disk), `cluster` (the API server, through the kubernetes client), `plugin` (the
sockets kubelet dials) and `node` (the mode's loop) carry it out.
"""
