/* CPU threads and memory bandwidth for the expert workers: pin an OpenMP team, stream-read a range.
 * Part of the library built from expert_ffn.c (cpu_expert_pool/native/build.py). */
#define _GNU_SOURCE
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define T_AVX2 __attribute__((target("avx2,fma")))
#endif

int ft_best_isa(void);           /* expert_ffn.c */
enum { ISA_AVX2 = 1 };           /* expert_ffn.c's ISA numbering */

/* Pin OpenMP thread i of a team of n to cpus[i]; libgomp keeps the team, so the pinning persists. */
int ft_pin_threads(const int32_t *cpus, int n) {
    int failures = 0;
    #pragma omp parallel num_threads(n) reduction(+ : failures)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        failures += pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0;
    }
    return failures;
}

/* Stream-read nbytes (a multiple of 64) with n threads; returns a checksum so nothing is elided. */
#if defined(__x86_64__)
T_AVX2 static uint64_t read_avx2(const uint8_t *p, int64_t lines, int num_threads) {
    uint64_t total = 0;
    #pragma omp parallel num_threads(num_threads) reduction(^ : total)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
        int64_t i = lines * tid / nth, end = lines * (tid + 1) / nth;
        for (; i + 2 <= end; i += 2) {
            const __m256i *q = (const __m256i *)(p + i * 64);
            a = _mm256_xor_si256(a, _mm256_loadu_si256(q));
            b = _mm256_xor_si256(b, _mm256_loadu_si256(q + 1));
            c = _mm256_xor_si256(c, _mm256_loadu_si256(q + 2));
            d = _mm256_xor_si256(d, _mm256_loadu_si256(q + 3));
        }
        for (; i < end; ++i) a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(p + i * 64)));
        __m256i x = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, x);
        total ^= lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
    }
    return total;
}
#endif

uint64_t ft_read_bytes(const void *p, int64_t nbytes, int num_threads) {
#if defined(__x86_64__)
    if (ft_best_isa() >= ISA_AVX2) return read_avx2((const uint8_t *)p, nbytes / 64, num_threads);
#endif
    const uint64_t *q = (const uint64_t *)p;
    const int64_t words = nbytes / 8;
    uint64_t total = 0;
    #pragma omp parallel for num_threads(num_threads) reduction(^ : total) schedule(static)
    for (int64_t i = 0; i < words; i += 8) {
        total ^= q[i] ^ q[i + 1] ^ q[i + 2] ^ q[i + 3] ^ q[i + 4] ^ q[i + 5] ^ q[i + 6] ^ q[i + 7];
    }
    return total;
}

