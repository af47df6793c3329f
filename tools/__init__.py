"""The project's developer tools (not in the wheel): ``tools.gpu`` (the GPU window),
``tools.kernel_build`` (offline GPU builds) and stand-alone scripts run by path."""
