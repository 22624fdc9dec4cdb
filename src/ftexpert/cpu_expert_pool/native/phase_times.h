/* Where a call of ft_moe_layer_q spends its time, by phase and thread: a build with -DFT_PHASE_TIMES only
 * (bench/bench_cpu_phases.py builds the kernel's library so; the worker's library has no marks and no cost).
 * Each thread stamps CLOCK_MONOTONIC at the marks below; the call stamps its entry and exit. The last call's stamps
 * are read by ft_quant_phase_times. Marks: 0 the parallel region entered; 1 phase 0 done (x converted and
 * quantized); 2 past its barrier; 3 phase 1 done (gate / up); 4 past its barrier; 5 h quantized (int8 path; else
 * the same as 4); 6 past its barrier; 7 phase 2 done (down), before the region's closing barrier. */
#ifndef FT_PHASE_TIMES_H
#define FT_PHASE_TIMES_H
#include <stdint.h>
#include <time.h>

#define PH_MARKS 8
#define PH_MAX_THREADS 256

#if defined(FT_PHASE_TIMES)
static int64_t ph_marks[PH_MAX_THREADS][PH_MARKS], ph_call[2];
static int ph_threads;
static inline int64_t ph_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
#define PHASE_CALL(k) (ph_call[(k)] = ph_now())
#define PHASE_MARK(tid, nth, k) do { if ((tid) < PH_MAX_THREADS) ph_marks[(tid)][(k)] = ph_now(); \
                                     if ((tid) == 0) ph_threads = (nth); } while (0)
#else
#define PHASE_CALL(k) ((void)0)
#define PHASE_MARK(tid, nth, k) ((void)0)
#endif

/* The last call's stamps (ns) into out: [call entry, call exit, threads, then PH_MARKS a thread]; returns the
   count written, or -1 in a build without FT_PHASE_TIMES. */
int ft_quant_phase_times(int64_t *out, int cap) {
#if defined(FT_PHASE_TIMES)
    const int nth = ph_threads < PH_MAX_THREADS ? ph_threads : PH_MAX_THREADS, need = 3 + nth * PH_MARKS;
    if (cap < need) return 0;
    out[0] = ph_call[0];
    out[1] = ph_call[1];
    out[2] = nth;
    for (int t = 0; t < nth; ++t)
        for (int k = 0; k < PH_MARKS; ++k) out[3 + t * PH_MARKS + k] = ph_marks[t][k];
    return need;
#else
    (void)out; (void)cap;
    return -1;
#endif
}
#endif /* FT_PHASE_TIMES_H */
