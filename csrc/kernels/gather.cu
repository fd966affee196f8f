// The gather kernel: one launch per log() call writes one row of the device ring.
//
// The row index comes from a counter in device memory, not from the host, so a CUDA graph that
// captured the launch appends a fresh row on every replay. One block; thread i handles cell i.
// Row layout (csrc/layout.h, shared with the host): seq, tag, step, time, gpu_ns,
// mask[mask_words], value[columns] (binary64). gpu_ns is %globaltimer, read once per launch.
// The step of a call without step= comes from the device too (the header's next-step word, which
// every launch sets to its step + 1): replays of a captured call, however many and whatever else
// the graph logs, take consecutive steps, and an eager call after them continues from there.
// Keep this file within PTX ISA 7.0 (sm_70): scripts/gen_ptx.py lowers the target for old drivers,
// which is why bf16 is converted by hand rather than with cvt.f32.bf16 (an sm_90 instruction).

#include "../layout.h"

typedef unsigned long long u64;

template <int K>
struct Args SL_LAUNCH_BLOCK(K);   // the launch's parameter block, as the host fills it

// An 8-bit float as binary64, built from its fields with integer operations only (exact, and
// nothing newer than PTX 7.0). Mirrors minifloat() in csrc/metric.c: "fn" formats have no
// infinity (all ones is NaN), "fnuz" ones no negative zero (0x80 is NaN), e8m0 is a bare exponent.
__device__ double minifloat(unsigned b, unsigned kind) {
    const double nan = __longlong_as_double(0x7ff8000000000000ll);
    if (kind == SL_F8E8M0FNU)
        return b == 0xff ? nan : __longlong_as_double((long long)(b + 1023 - 127) << 52);
    int e = 4, m = 3, bias = 7;
    if (kind == SL_F8E5M2) e = 5, m = 2, bias = 15;
    if (kind == SL_F8E4M3FNUZ) bias = 8;
    if (kind == SL_F8E5M2FNUZ) e = 5, m = 2, bias = 16;
    if ((kind == SL_F8E4M3FNUZ || kind == SL_F8E5M2FNUZ) && b == 0x80) return nan;
    if (kind == SL_F8E4M3FN && (b & 0x7f) == 0x7f) return nan;
    const unsigned ex = (b >> m) & ((1u << e) - 1), man = b & ((1u << m) - 1);
    const long long sign = (long long)(b >> 7) << 63;
    if (kind == SL_F8E5M2 && ex == 31)
        return man ? nan : __longlong_as_double(sign | 0x7ff0000000000000ll);
    double v;
    if (ex)   // normal: exponent rebased, mantissa moved to the top of binary64's 52 bits
        v = __longlong_as_double(((long long)(ex - bias + 1023) << 52) |
                                 ((long long)man << (52 - m)));
    else      // subnormal: man * 2^(1 - bias - m), a power of two times a small integer
        v = (double)man * __longlong_as_double((long long)(1023 + 1 - bias - m) << 52);
    return __longlong_as_double(__double_as_longlong(v) | sign);
}

__device__ double load(const sl_cell &c) {
    const void *p = (const void *)c.bits;
    switch (c.kind) {
    case SL_HOST: return __longlong_as_double((long long)c.bits);
    case SL_F16: {
        unsigned short h = *(const unsigned short *)p;
        float f;
        asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
        return f;
    }
    case SL_BF16: return __int_as_float((int)(*(const unsigned short *)p) << 16);
    case SL_F32: return *(const float *)p;
    case SL_F64: return *(const double *)p;
    case SL_I8: return *(const signed char *)p;
    case SL_I16: return *(const short *)p;
    case SL_I32: return *(const int *)p;
    case SL_I64: return (double)*(const long long *)p;
    case SL_U8: return *(const unsigned char *)p;
    case SL_U16: return *(const unsigned short *)p;
    case SL_U32: return *(const unsigned *)p;
    case SL_U64: return (double)*(const u64 *)p;
    case SL_BOOL: return *(const unsigned char *)p ? 1.0 : 0.0;
    case SL_F8E4M3FN: case SL_F8E5M2: case SL_F8E4M3FNUZ: case SL_F8E5M2FNUZ: case SL_F8E8M0FNU:
        return minifloat(*(const unsigned char *)p, c.kind);
    }
    return __longlong_as_double(0x7ff8dead00000000ll);   // unreachable: the host checks kinds
}

template <int K>
__device__ void gather(const Args<K> &a) {
    const sl_launch &h = a.head;
    u64 *counter = (u64 *)h.counter + SL_HDR_COUNTER;
    const u64 seq = *counter;
    u64 *row = (u64 *)h.ring + (seq % h.capacity) * h.row_words;
    u64 *mask = row + SL_ROW_HEADER_WORDS;
    const unsigned t = threadIdx.x;
    if (t < h.mask_words) mask[t] = 0;
    if (t == 0) {
        u64 now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        row[SL_ROW_SEQ] = seq;
        row[SL_ROW_TAG] = h.tag;
        u64 *next = (u64 *)h.counter + SL_HDR_NEXT_STEP;
        const long long step = h.step < 0 ? (long long)*next : h.step;
        *next = (u64)(step + 1);
        row[SL_ROW_STEP] = (u64)step;
        row[SL_ROW_TIME] = (u64)__double_as_longlong(h.time);
        row[SL_ROW_GPU_NS] = now;
    }
    __syncthreads();
    if (t < h.n) {
        const sl_cell c = a.cell[t];
        mask[h.mask_words + c.column] = (u64)__double_as_longlong(load(c));
        atomicOr(&mask[c.column / SL_COLUMN_BLOCK], 1ull << (c.column % SL_COLUMN_BLOCK));
    }
    __syncthreads();
    if (t == 0) *counter = seq + 1;
}

// One entry point per parameter-block size (layout.h's SL_GATHER_KERNELS).
#define SL_ENTRY(name, cells) \
    extern "C" __global__ void name(const Args<cells> a) { gather(a); }
SL_GATHER_KERNELS(SL_ENTRY)
