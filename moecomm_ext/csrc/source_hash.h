// The hash of the sources an extension was built from (moecomm_ext/_specs.py), passed by
// the build as -DMOECOMM_EXT_SOURCE_HASH=<12 hex digits> and exposed as the module's
// `source_hash`, so that the loader never uses a library older than its sources.
#pragma once

#ifndef MOECOMM_EXT_SOURCE_HASH
#define MOECOMM_EXT_SOURCE_HASH unknown
#endif
#define MOECOMM_EXT_STR2(x) #x
#define MOECOMM_EXT_STR(x) MOECOMM_EXT_STR2(x)
#define MOECOMM_EXT_SOURCE_HASH_STR MOECOMM_EXT_STR(MOECOMM_EXT_SOURCE_HASH)
