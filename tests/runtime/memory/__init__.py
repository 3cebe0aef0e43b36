"""Tests of zeropipe/runtime/memory."""
