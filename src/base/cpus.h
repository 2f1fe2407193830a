/* cpus.h — CPU lists ("0-3,8", taskset -c's form), the CPUs this process
 * may run on, and pinning threads to one CPU (prefix cpus_).
 *
 * Owns: parsing and checking lists, a thread attribute that starts a thread
 * on one CPU, pinning the calling thread and putting its CPUs back.
 * Refuses: choosing CPUs (the caller names them). Linux (glibc) only: where
 * threads cannot be pinned, every list is refused with a message saying so.
 */
#ifndef DF_BASE_CPUS_H
#define DF_BASE_CPUS_H
#include <pthread.h>
#include <stddef.h>

enum { CPUS_MAX = 1024 }; /* CPU numbers run 0 .. CPUS_MAX - 1 (glibc's CPU_SETSIZE) */

/* Parses a list of CPU numbers and ranges, e.g. "0-3,8,10-11", into cpus
 * (in the order written; room for cap); returns how many, or -1 with err
 * saying what is wrong (the syntax, a CPU listed twice, more than cap, or a
 * CPU this process may not run on, naming the ones it may). */
int cpus_parse(const char *s, int *cpus, int cap, char *err, size_t errcap);
/* 0 if each of the n CPUs is one this process may run on; else -1 with err. */
int cpus_check(const int *cpus, int n, char *err, size_t errcap);
/* Sets attr (initialised by the caller) to start its thread on cpu; 0 or an errno. */
int cpus_attr_pin(pthread_attr_t *attr, int cpu);

/* The calling thread's CPUs, saved so they can be put back. */
typedef struct cpus_saved cpus_saved;
/* Pins the calling thread to cpu; *saved (when saved is not NULL) receives
 * its CPUs before (free with cpus_restore). 0 or an errno. */
int cpus_pin_self(int cpu, cpus_saved **saved);
/* Puts the calling thread's CPUs back to those saved and frees saved (NULL: nothing). */
void cpus_restore(cpus_saved *saved);
#endif
