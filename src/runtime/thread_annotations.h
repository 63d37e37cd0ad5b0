#pragma once
// Clang thread-safety annotations (-Wthread-safety); they compile to nothing
// on other compilers. A field marked GUARDED_BY(mu_) is read and written only
// with mu_ held.

#if defined(__clang__)
#define SPILLWAY_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define SPILLWAY_THREAD_ANNOTATION(x)
#endif

#define GUARDED_BY(x) SPILLWAY_THREAD_ANNOTATION(guarded_by(x))
#define REQUIRES(...) SPILLWAY_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) SPILLWAY_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
