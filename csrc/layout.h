/* The ABI shared by the host C code and the gather kernel (csrc/kernels/gather.cu includes this
 * file too): the ring's byte layout, the launch's parameter block, the kernel sizes and the kind
 * numbers. Each fact is written here once; the module exports them to Python (_C.HEADER_BYTES,
 * _C.ROW_HEADER_WORDS, ...). Plain C: macros, an enum and two structs that nvcc and a C compiler
 * both read. */
#ifndef SYNCLESS_LAYOUT_H
#define SYNCLESS_LAYOUT_H

#include <stdint.h>

/* Device ring: a header of SL_HEADER_BYTES (word SL_HDR_COUNTER: the write counter, rows ever
 * written; word SL_HDR_NEXT_STEP: the step a log() without step= takes), then rows of 8-byte words:
 * SL_ROW_HEADER_WORDS words (below), the presence mask (one bit per column, in words of 64), then
 * one binary64 value per column. */
#define SL_HEADER_BYTES 2048
#define SL_HDR_COUNTER 0
#define SL_HDR_NEXT_STEP 1
#define SL_ROW_SEQ 0    /* the row's sequence number (the counter when it was written) */
#define SL_ROW_TAG 1    /* the host's call id; SL_CAPTURED_TAG set for a graph-captured call */
#define SL_ROW_STEP 2   /* int64 */
#define SL_ROW_TIME 3   /* host wall time of the call, binary64 seconds */
#define SL_ROW_GPU_NS 4 /* %globaltimer when the kernel ran, ns (GPU clock, 32 ns tick on H200) */
#define SL_ROW_HEADER_WORDS 5
#define SL_COLUMN_BLOCK 64 /* columns come in blocks of one mask word */
#define SL_CAPTURED_TAG (1ull << 63)

/* Cells per gather launch: 248 of 16 bytes and the launch header fill the classic 4 KB kernel
 * parameter limit (ring.c checks it). */
#define SL_MAX_CELLS 248

/* The gather kernel in three parameter-block sizes, smallest first, so a call with few metrics
 * does not copy 4 KB of launch parameters: X(entry point, cells) for each. A launch takes the
 * first kernel whose block holds its cells. */
#define SL_GATHER_KERNELS(X) X(sl_gather8, 8) X(sl_gather64, 64) X(sl_gather_max, SL_MAX_CELLS)
#define SL_GATHER_COUNT 3

/* One cell of a launch: what the gather kernel reads for one metric. */
typedef struct {
    uint64_t bits; /* device address, or the value itself (binary64 bits) for SL_HOST */
    uint32_t column;
    uint32_t kind; /* enum sl_kind */
} sl_cell;

/* The head of the gather kernel's one parameter, passed by value (SL_LAUNCH_BLOCK below). */
typedef struct {
    uint64_t ring;    /* device address of row 0 */
    uint64_t counter; /* device address of the header (the write counter, the next step) */
    uint64_t tag;     /* the host's call id (SL_CAPTURED_TAG: the call was captured into a graph) */
    int64_t step;     /* the call's step= (>= 0), or -1: the header's next-step word */
    double time;      /* host wall time of the call */
    uint32_t capacity; /* rows */
    uint32_t row_words;
    uint32_t mask_words;
    uint32_t n; /* cells used in this launch */
} sl_launch;

/* The gather kernel's parameter block for K cells: the head, then the cells; the body of a struct
 * (`struct Args SL_LAUNCH_BLOCK(K);`). The host fills one of SL_MAX_CELLS cells and hands it to
 * every kernel size; a kernel's parameter copy takes only its own K. */
#define SL_LAUNCH_BLOCK(K)                                                                         \
    {                                                                                              \
        sl_launch head;                                                                            \
        sl_cell cell[K];                                                                           \
    }

/* What the gather kernel reads for one cell. */
enum sl_kind {
    SL_HOST = 0, /* value carried by the launch itself (a Python number or a CPU tensor) */
    SL_F16,
    SL_BF16,
    SL_F32,
    SL_F64,
    SL_I8,
    SL_I16,
    SL_I32,
    SL_I64,
    SL_U8,
    SL_U16,
    SL_U32,
    SL_U64,
    SL_BOOL,
    SL_F8E4M3FN,
    SL_F8E5M2,
    SL_F8E4M3FNUZ,
    SL_F8E5M2FNUZ,
    SL_F8E8M0FNU,
};

#endif
