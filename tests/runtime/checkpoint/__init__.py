"""Tests of zeropipe/runtime/checkpoint."""
