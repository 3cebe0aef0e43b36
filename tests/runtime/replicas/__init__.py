"""Tests of zeropipe/runtime/replicas."""
