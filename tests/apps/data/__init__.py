"""Tests of zeropipe/apps/data."""
