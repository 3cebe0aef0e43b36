"""Tests of zeropipe/core/passes."""
