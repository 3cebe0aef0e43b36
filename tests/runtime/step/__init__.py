"""Tests of zeropipe/runtime/step."""
