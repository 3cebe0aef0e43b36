"""Tests of zeropipe/runtime/transport."""
