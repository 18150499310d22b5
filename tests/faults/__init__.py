"""The fault campaign: a rank that exits, sleeps or raises at each phase of moecomm's work.

``python -m tests.faults`` runs the whole matrix (see ``campaign.py``); ``tests/test_faults.py``
runs a representative subset under pytest.
"""
