/* The ABI shared by the host C code and the gather kernel (csrc/kernels/gather.cu includes this
 * file too): the ring's byte layout, the cell limit and the kind numbers. Each fact is written
 * here once; the module exports them to Python (_C.HEADER_BYTES, _C.ROW_HEADER_WORDS, ...).
 * Plain C macros and an enum only: nvcc and a C compiler both read it. */
#ifndef SYNCLESS_LAYOUT_H
#define SYNCLESS_LAYOUT_H

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
 * parameter limit. */
#define SL_MAX_CELLS 248

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
