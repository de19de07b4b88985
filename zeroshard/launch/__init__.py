"""Process start-up: torchrun's environment from other launchers, the process group, the device,
the command-line flags a DeepSpeed script adds, and `zeroshard launch`."""
