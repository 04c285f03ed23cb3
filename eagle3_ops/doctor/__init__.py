"""Wiring doctor: which target hidden states does an engine feed an EAGLE-3 draft, and are they the
ones it was trained on? See ``python -m eagle3_ops doctor --help`` and docs/doctor.md ("My acceptance
rate is low — is it wiring?")."""
from .configs import DoctorInputError

__all__ = ["DoctorInputError"]
