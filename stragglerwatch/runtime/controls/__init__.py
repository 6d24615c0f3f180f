"""Runtime control without a restart: the settings (``controlspec``), their application (``control``), the
control file (``controlfile``) and the debug server (``debugserver``, ``debugstack``).
"""
