"""Tests of zeropipe/planning."""
