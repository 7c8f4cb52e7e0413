"""`bench.client_save_profile --cprofile-service NAME`: put on `PYTHONPATH` of the cluster's
processes, it profiles the main thread (the event loop) of the one whose command line holds the
`-m KVF_PROFILE_SERVICE` (e.g. `kvfabric.directory`) between SIGUSR1 (enable) and SIGUSR2
(disable, write `KVF_PROFILE_SERVICE_OUT`). Any other process: nothing."""

import os

_want = os.environ.get("KVF_PROFILE_SERVICE", "").encode()
try:
    with open("/proc/self/cmdline", "rb") as _f:
        _argv = _f.read().split(b"\0")
except OSError:
    _argv = []
if _want and b"-m" in _argv[:-1] and _argv[_argv.index(b"-m") + 1] == _want:
    import cProfile
    import signal

    _profile = cProfile.Profile()

    def _enable(_signum: int, _frame: object) -> None:
        _profile.enable()

    def _disable(_signum: int, _frame: object) -> None:
        _profile.disable()
        _profile.dump_stats(os.environ["KVF_PROFILE_SERVICE_OUT"])

    signal.signal(signal.SIGUSR1, _enable)
    signal.signal(signal.SIGUSR2, _disable)
