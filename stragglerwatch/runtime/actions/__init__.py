"""The opt-in policies: ending a hung rank (``hangabort``) and acting on a lasting straggler
(``stragglerpolicy``).
"""
