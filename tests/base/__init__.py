"""Tests of zeropipe/base."""
