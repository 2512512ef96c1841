"""Process supervision around a launcher (``dsclip launch``): see :mod:`dsclip.launch.supervise`."""
