"""Precision: the plan (one dtype per tensor role and parameter group), loss scaling, and the
forward's autocast context."""
