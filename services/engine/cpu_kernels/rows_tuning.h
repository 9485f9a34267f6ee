/* Part of rows.c (included there once, so its loops inline into the dispatch): what this build's CPU has
 * (HAVE_*), and how far and into which cache the loops prefetch. Each default says what it measured where;
 * -DNAME=... in HINTSERVE_KERNEL_FLAGS overrides one, and `hintserve bench kernel-flags` times the two builds
 * side by side. */
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define HAVE_AVX512 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_VNNI512 1
#endif
/* AVX2 with FMA (Haswell on, Zen 1 on: most servers and laptops without AVX-512) has 256-bit loops
 * (rows_float.h, rows_int_avx2.h); an AVX-512 build without VNNI takes them too for int8 and int4 (one without
 * BF16 widens bf16 at 512 bits). AVX-VNNI (Alder Lake, Zen 5) adds the 256-bit vpdpbusd. */
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#endif
#if defined(HAVE_AVX2) && defined(__AVXVNNI__)
#define HAVE_AVXVNNI 1
#endif

#define INLINE static inline __attribute__((always_inline))
/* How far ahead the lighter streams (int4) prefetch: a DRAM latency's worth of bytes. At 1 KB int4 streamed
 * 55-75% of the read probe on one thread (Zen 5), at 4 KB 83-93%; on an Intel Xeon guest 2 KB was 10% slower
 * and 8 KB no faster. The heavier streams (one-row fp32 and bf16, int8 tiles) prefetch twice as far, every line
 * they read: on a second Xeon guest the one-row bf16 loop, prefetching one of its two lines a step, read
 * 10.5 GB/s on one thread against fp32's 14.5; both lines: 14.5-15.3 (int8 tiles: +4-6%).
 * -DPREFETCH_BYTES=... in HINTSERVE_KERNEL_FLAGS tries another distance. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif
/* AMD's Zen 3 and later (GCC 12 calls a Zen 4 znver3, with AVX-512 or with it hidden by a hypervisor), and
 * those of them with AVX-512, whose loops the defaults below tune apart. */
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define AMD_ZEN3_ON 1
#else
#define AMD_ZEN3_ON 0
#endif
#if defined(__AVX512F__) && AMD_ZEN3_ON
#define AMD_AVX512 1
#else
#define AMD_AVX512 0
#endif
/* Zen 5 apart from Zen 4: GCC 14 names it; GCC 12 calls both znver3, and only Zen 5 has AVX-VNNI. */
#if defined(__znver5__) || (AMD_AVX512 && defined(__AVXVNNI__))
#define AMD_ZEN5_ON 1
#else
#define AMD_ZEN5_ON 0
#endif
/* The 512-bit one-row fp32 loop on AMD's AVX-512 cores: half the distance, into L2. A Zen 4 guest's one-row
 * fp32 expert streamed 48-64% of the read probe on one thread at 8 KB into L1, 49-79% at 4 KB into L2, and
 * 43-72% against 84-96% on two (alternating builds, three rounds; the LM head alike). bf16 was mixed there
 * (its LM head better, its expert worse on two threads): unchanged. */
#if AMD_AVX512
#define PREFETCH_F32_DEFAULT 4096
#define PREFETCH_HINT_F32_DEFAULT _MM_HINT_T1
#else
#define PREFETCH_F32_DEFAULT (2 * PREFETCH_BYTES)
#define PREFETCH_HINT_F32_DEFAULT PREFETCH_HINT
#endif
#ifndef PREFETCH_BYTES_F32
#define PREFETCH_BYTES_F32 PREFETCH_F32_DEFAULT
#endif
#ifndef PREFETCH_HINT_F32
#define PREFETCH_HINT_F32 PREFETCH_HINT_F32_DEFAULT
#endif
/* The integer tiles prefetch into L2 instead, as expert_f32.c's loops do: into L1 their prefetches queue on its
 * few miss buffers (Xeon guest, one row, huge pages, alternating builds: int4 +5-13%, int8 a few %; the float
 * loops were tuned with T0 and not re-timed). */
#ifndef PREFETCH_HINT_INT
#define PREFETCH_HINT_INT _MM_HINT_T1
#endif
/* The widened bf16 loop of AVX-512 builds without a bf16 dot product prefetches into L2: on an Intel Xeon guest
 * (AVX-512 VNNI, bf16 and AMX hidden; one process alternating builds, three rounds) its one-row matrices read
 * 67-84% of the read probe prefetched into L1 and 76-92% into L2. */
#ifndef PREFETCH_HINT_BF16W
#define PREFETCH_HINT_BF16W _MM_HINT_T1
#endif
/* The 256-bit one-row float loops do not prefetch: on a Zen 3 guest (AVX2 only; one process alternating
 * builds, 256 MB of weights, one thread) fp32 streamed 13.2 GB/s without against 11.3 at 8 KB ahead, bf16
 * 10.6 against 9.5 (at 512 B: 11.1 and 11.3), its hardware prefetchers alone doing better. Untimed on an
 * Intel CPU without AVX-512; -DPREFETCH_BYTES_AVX2_FLOAT=8192 in HINTSERVE_KERNEL_FLAGS tries one there. */
#ifndef PREFETCH_BYTES_AVX2_FLOAT
#define PREFETCH_BYTES_AVX2_FLOAT 0
#endif
/* Whether the one-row bf16, int8 and int4 loops prefetch. A Zen 4 guest's hardware prefetchers alone read
 * one stream at 30 GB/s on one thread, and at 21-24 with a software prefetch 2-8 KB ahead. There (one process
 * alternating builds, three rounds each) bf16 ran 5-25% faster per matrix without it, int8 5-25% faster at
 * one row but 25-50% slower at 16 rows (so its tiles keep it for two rows and more); fp32 10-20% slower
 * (keeps its own, above). int4 came out even on one guest and, on a later one, 5-16% faster without in 8 of
 * 10 matrix x thread cases (four rounds; prefetching 8-64 KB ahead, or a group's lines at once, into L1 or
 * L2, was slower still in a standalone loop). -DSW_PREFETCH=1 there brings them back. A Zen 3 guest (AVX2
 * only) keeps them: without, its one-row int8, int4 and bf16 experts and LM heads ran 0.88-1.07 times as fast
 * (`bench kernel-flags`, six rounds, one and two threads; bench/results/kernel_flags_zen3_sw_prefetch.json). */
#if AMD_AVX512
#define SW_PREFETCH_DEFAULT 0
#else
#define SW_PREFETCH_DEFAULT 1
#endif
#ifndef SW_PREFETCH
#define SW_PREFETCH SW_PREFETCH_DEFAULT
#endif
/* Activation rows from which the int4 tiles prefetch (below SW_PREFETCH's one row). Its tiles are one
 * stream, scales among the nibbles; on a Zen 4 guest two rows ran a third faster without (a tile read once,
 * quickly, is what the hardware prefetchers follow best), three to sixteen 5-40% slower (two rounds). */
#ifndef Q4_PREFETCH_ROWS
#define Q4_PREFETCH_ROWS 3
#endif
/* One activation row over int4 tiles prefetches every line non-temporally on AMD's AVX-512 cores, where the
 * loops otherwise leave the stream to the hardware prefetchers (SW_PREFETCH): a decode step streams tens of MB
 * of experts a layer, which flushed the caches of the Python, torch and small native calls between the
 * matrices. On a Zen 4 guest a small call after a 40 MB plain read loop took 37-40 us, after the same loop
 * prefetching NTA 13-14 (both loops 30-31 GB/s). Whole-model int4 decode there, one process alternating
 * builds, 14 rounds, the same tokens: +1.8% on one thread, +3.5% on two, although a layer's experts alone
 * ran 2-4% slower (1 KB ahead; 2 KB: +2.0% and -4.4%, 4 KB: -12% alone). bf16 (-11%) and int8 (-4%)
 * decoded slower that way and keep their loops. A Zen 5 guest's full-width cores want it further ahead: 4 KB
 * there read 81-98% of the probe per one-row matrix against 75-88% at 1 KB (8 KB: 78-89%, none: 76-100%;
 * three rounds alternating builds), and whole-model int4 decode ran 10% faster on one thread (median of three;
 * two threads even). -DQ4_NTA=0 turns it off, -DQ4_NTA_BYTES= sets the distance. */
#if AMD_AVX512
#define Q4_NTA_DEFAULT 1
#else
#define Q4_NTA_DEFAULT 0
#endif
#ifndef Q4_NTA
#define Q4_NTA Q4_NTA_DEFAULT
#endif
#ifndef Q4_NTA_BYTES
#define Q4_NTA_BYTES (AMD_ZEN5_ON ? 4096 : 1024)
#endif
#define SPLIT_MAX 4 /* activation rows up to which each row's integer dot products run on two chains */
