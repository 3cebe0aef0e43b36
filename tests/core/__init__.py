"""Tests of zeropipe/core."""
