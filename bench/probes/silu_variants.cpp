// silu_mul's bf16 row ([32, 2 x 1536] -> [32, 1536], one thread, hot) in six variants of
// silu_mul_row_wide (kvserve_cpu_ops.cpp), for session 23's choice of its rounding and exp:
//   V0: the division, bf16 rounding by six integer instructions, exp by the exponent-bits add
//   V1: V0 with rcp14 + one Newton step instead of the division
//   V2: V0 with vcvtneps2bf16 rounding
//   V3: V1 with vcvtneps2bf16 rounding
//   V4: V2 with exp's 2^n by vscalefps (what the kernel does since session 23)
//   V5: V0 with the vscalefps exp
// Prints us per call and how many outputs differ from V0.
//   g++ -O3 -march=native bench/probes/silu_variants.cpp -o /tmp/silu && /tmp/silu
// The AMX Xeon (bench/results/session23/cpu.txt), session 23: V0 35.24, V1 37.03 (21 of 49152
// outputs differ), V2 27.88 (0), V3 28.50 (21), V4 25.94 (0), V5 32.78 (0).
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.37626f), _mm512_max_ps(_mm512_set1_ps(-87.33654f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvttps_epi32(n), 23));
  const __mmask16 zero = _mm512_cmp_ps_mask(n, _mm512_set1_ps(-126.0f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(zero, _mm512_castsi512_ps(bits), _mm512_setzero_ps());
}
inline __m512 load16(const uint16_t* p, __mmask16 m){ const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)); return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline __m512i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb);
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0));
}
inline __m512 round16(__m512 v){ return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }
inline void store16(uint16_t* p, __mmask16 m, __m512 v){ _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits16(v))); }
// native bf16 variants
inline __m512 round16b(__m512 v){ return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)),16)); }
inline void store16b(uint16_t* p, __mmask16 m, __m512 v){ _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v)); }
inline __m512 exp16s(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.37626f), _mm512_max_ps(_mm512_set1_ps(-87.33654f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
template<int V>
void silu_row(const uint16_t* gu, uint16_t* o, int64_t inter) {
  const uint16_t* u = gu + inter;
  const __m512i sign = _mm512_set1_epi32(int(0x80000000u));
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  for (int64_t i = 0; i < inter; i += 16) {
    const __mmask16 m = inter - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (inter - i)) - 1);
    const __m512 x = load16(gu + i, m);
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
    const __m512 d = _mm512_add_ps(one, V >= 4 ? exp16s(neg) : exp16(neg));
    __m512 s;
    if (V == 0 || V == 2 || V == 4 || V == 5) s = _mm512_div_ps(x, d);
    else { __m512 r = _mm512_rcp14_ps(d); r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, two)); s = _mm512_mul_ps(x, r); }
    if (V <= 1 || V == 5) { store16(o + i, m, _mm512_mul_ps(round16(s), load16(u + i, m))); }
    else { store16b(o + i, m, _mm512_mul_ps(round16b(s), load16(u + i, m))); }
  }
}
int main(){
  const int rows=32, inter=1536; std::mt19937 g(0); std::normal_distribution<float> nd(0, 3);
  std::vector<uint16_t> gu(rows*2*inter); for(auto&v:gu){ float f=nd(g); uint32_t b; memcpy(&b,&f,4); v=b>>16; }
  std::vector<std::vector<uint16_t>> outs(6, std::vector<uint16_t>(rows*inter));
  for (int V=0; V<6; ++V){ double best=1e9;
    for(int rep=0;rep<5;++rep){ auto t=std::chrono::steady_clock::now();
      for(int it=0;it<1000;++it) for(int r=0;r<rows;++r){
        uint16_t* o=outs[V].data()+r*inter; const uint16_t* p=gu.data()+r*2*inter;
        if(V==0) silu_row<0>(p,o,inter); else if(V==1) silu_row<1>(p,o,inter); else if(V==2) silu_row<2>(p,o,inter); else if(V==3) silu_row<3>(p,o,inter); else if(V==4) silu_row<4>(p,o,inter); else silu_row<5>(p,o,inter);}
      double us=std::chrono::duration<double,std::micro>(std::chrono::steady_clock::now()-t).count()/1000; if(us<best)best=us;}
    int diff=0; for(int i=0;i<rows*inter;++i) diff+=outs[V][i]!=outs[0][i];
    printf("V%d: %.2f us per [32,1536], diffs vs V0: %d of %d\n", V, best, diff, rows*inter);}
}
